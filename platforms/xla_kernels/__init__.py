"""Kernels written for XLA (torch traced by torch-xla): every kernel entry of k3 as XLA-clean torch,
static shapes, no host read of a device value, no data-dependent shape, no op torch-xla runs on
the host. The tpu platform serves them (`tables`: its kernel tables); they run on any torch-xla
device (a TPU, PJRT's CPU device in CI's tpu tier) and on the CPU, where tests/tpu and
`k3 conformance --platform tpu` check them against the naive oracles in `k3.reference`. Like the
other kernel libraries they import only the contract, the reference, `k3.ops_helpers`,
`k3.quant`, `k3.dtypes` and the torch kernels; torch-xla itself only where a kernel needs it
(the scan), imported lazily.
"""
