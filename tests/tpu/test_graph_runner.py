"""The tpu graph runner (`k3_graph_runner`, platforms/tpu/graphs.py): one compilation per
bucket at capture, none in steady state. 50 replays of one bucket (B = 8) with the batch
changing inside it (N = 5..8), the metadata padded on the host and uploaded whole as
`DecodeGraphs` does for a runner with `pads_on_host`; torch-xla's `UncachedCompile` counter
must not move, and every replay's real rows equal the same step computed eagerly on the CPU.
The step is kernel-sized (embedding gather, the tpu plugin's rms_norm, a projection) rather
than the whole model: a k3-tiny engine step on PJRT CPU is not yet fast enough for the tier."""

import torch

B, D, V = 8, 16, 32


def _step(ids, pos, emb, pos_emb, norm_w, head, rms_norm):
    return rms_norm(emb[ids] + pos_emb[pos], norm_w, 1e-6) @ head.T


def test_replays_inside_a_bucket_compile_nothing():
    import torch_xla
    import torch_xla.debug.metrics as met

    from k3.platform import select_platform

    tpu = select_platform("tpu")
    runner = tpu.graph_runner
    assert getattr(runner, "pads_on_host", False)
    rms_norm = tpu.kernels.elementwise.rms_norm
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(V, D, generator=g), torch.randn(64, D, generator=g), torch.rand(D, generator=g) + 0.5,
               torch.randn(V, D, generator=g)]
    dev = torch_xla.device()
    on_dev = [w.to(dev) for w in weights]
    ids, pos = torch.zeros(B, dtype=torch.long, device=dev), torch.zeros(B, dtype=torch.long, device=dev)

    before = met.counter_value("UncachedCompile") or 0
    replay, logits = runner.capture(lambda: _step(ids, pos, *on_dev, rms_norm))
    at_capture = (met.counter_value("UncachedCompile") or 0) - before
    assert at_capture >= 1

    for step in range(50):
        n = 5 + step % 4
        host_ids = torch.zeros(B, dtype=torch.long)
        host_pos = torch.zeros(B, dtype=torch.long)
        host_ids[:n] = torch.randint(0, V, (n,), generator=g)
        host_pos[:n] = torch.randint(0, 64, (n,), generator=g)
        ids.copy_(host_ids.to(dev))
        pos.copy_(host_pos.to(dev))
        replay()
        got = logits.cpu()[:n]                      # whole-bucket read, sliced on the host
        want = _step(host_ids[:n], host_pos[:n], *weights, rms_norm)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    steady = (met.counter_value("UncachedCompile") or 0) - before - at_capture
    assert steady == 0, f"{steady} XLA compilation(s) in 50 steady-state replays (capture: {at_capture})"
