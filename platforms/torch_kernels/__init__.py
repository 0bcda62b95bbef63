"""Kernels written with torch itself (no Triton): the fast pure-torch paths the reference
platform serves (`tables.torch_tables()`: chunked KDA, the vectorised recurrence, batched paged
MLA and indexer decode, expert dispatch, the butterfly Hadamard...) and the ones the GPU
plugins serve (blocked chunked KDA, SDPA prefill, radix top-k). Each has its entry's protocol
(`k3.plugin.kernels`), runs on any torch device, and is checked on the CPU against the naive
oracle in `k3.reference` by conformance and tests/kernels. They import only the contract, the
reference, `k3.ops_helpers`, `k3.quant` and `k3.dtypes`.
"""
