"""The tpu plugin's KDA chunked prefill (platforms/xla_kernels/kda_chunked.py) on the XLA device against
`k3.reference.kda_chunked` (float64 on the CPU): packed ragged sequences (one of length 0),
checkpoints at offsets inside chunks, lanes without `cu_seqlens`; no CPU fallback and no
device-to-host transfer inside the call, one compiled graph per shape."""

import pytest
import torch

from k3 import reference as ref


def _inputs(B, T, H, HV, K, V, N, seed):
    g = torch.Generator().manual_seed(seed)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g), dim=-1)   # noqa: E731
    return (unit(B, T, H, K), unit(B, T, H, K), torch.randn(B, T, HV, V, generator=g),
            -torch.rand(B, T, HV, K, generator=g), torch.rand(B, T, HV, generator=g),
            torch.randn(N, HV, K, V, generator=g))


@pytest.mark.parametrize("lens,B,T,offsets", [
    ((50, 0, 51), 1, 101, [[0, 50], [0, 0], [20, 51]]),
    (None, 2, 70, [0, 64, 65, 70]),
    ((13, 17), 1, 30, None),
], ids=["ragged3_with_empty_checkpoints", "B2_T70_lanes_checkpoints", "ragged2_T30"])
def test_scan_matches_the_reference(lens, B, T, offsets):
    import torch_xla
    import torch_xla.debug.metrics as met

    from k3.platforms.xla_kernels.kda_chunked import kda_chunked

    N = len(lens) if lens else B
    q, k, v, g, beta, init = _inputs(B, T, 2, 4, 16, 32, N, seed=T)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    offs = torch.tensor(offsets) if offsets and isinstance(offsets[0], list) else offsets
    dev = torch_xla.device()
    args = [x.to(dev) for x in (q, k, v, g, beta)]
    kw = dict(initial_state=init.to(dev), cu_seqlens=None if cu is None else cu.to(dev),
              checkpoint_offsets=None if offs is None else (offs.to(dev) if isinstance(offs, torch.Tensor) else offs))
    torch_xla.sync()
    met.clear_all()
    out = kda_chunked(*args, **kw)
    torch_xla.sync()
    assert not [c for c in met.counter_names() if c.startswith("aten::")]
    assert (met.metric_data("TransferFromDeviceTime") or (0,))[0] == 0
    assert met.counter_value("UncachedCompile") == 1
    want = ref.kda_chunked(*(x.double() for x in (q, k, v, g, beta)), initial_state=init.double(), cu_seqlens=cu,
                           checkpoint_offsets=offs)
    got = [out.o, out.state, *out.checkpoints]
    exp = [want.o, want.state, *want.checkpoints]
    assert len(got) == len(exp)
    for a, b in zip(got, exp):
        torch.testing.assert_close(a.cpu().double(), b, rtol=1e-4, atol=1e-5)
