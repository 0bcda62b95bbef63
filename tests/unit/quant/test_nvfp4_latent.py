"""The NVFP4 latent record (k3.quant.nvfp4_latent) against an independent byte-level reading:
E2M1 nibbles decoded by hand from the code table, E4M3 bytes through torch's float8."""

import pytest
import torch

from k3.cache.records import latent_record_bytes
from k3.config import K3Config
from k3.quant.fp4 import E2M1_VALUES
from k3.quant.nvfp4_latent import nvfp4_latent_dequantize, nvfp4_latent_quantize, nvfp4_latent_record_bytes


def _by_hand(records: torch.Tensor, r: int, gs: float) -> torch.Tensor:
    """Decode records [T, R/2 + R/16 + Dr] byte by byte (no k3 codec)."""
    out = []
    for rec in records.tolist():
        codes = [c for b in rec[: r // 2] for c in (b & 15, b >> 4)]
        scales = torch.tensor(rec[r // 2: r // 2 + r // 16], dtype=torch.uint8).view(torch.float8_e4m3fn).double()
        c = [E2M1_VALUES[code] * scales[i // 16].item() * gs for i, code in enumerate(codes)]
        pe = (torch.tensor(rec[r // 2 + r // 16:], dtype=torch.uint8).view(torch.float8_e4m3fn).double() * gs)
        out.append(torch.cat([torch.tensor(c, dtype=torch.float64), pe]))
    return torch.stack(out)


@pytest.mark.parametrize("gs", [1.0, 0.25])
def test_records_decode_as_their_bytes_say_and_stay_close(gs):
    g = torch.Generator().manual_seed(2)
    r, dr = 32, 8
    rows = torch.randn(5, r + dr, generator=g, dtype=torch.float64) * 2
    records = nvfp4_latent_quantize(rows, kv_lora_rank=r, global_scale=gs)
    assert records.dtype == torch.uint8 and records.shape == (5, nvfp4_latent_record_bytes(r, dr)) == (5, 26)
    decoded = nvfp4_latent_dequantize(records, kv_lora_rank=r, global_scale=gs, dtype=torch.float64)
    torch.testing.assert_close(decoded, _by_hand(records, r, gs), rtol=0, atol=0)
    err = (decoded[:, :r] - rows[:, :r]).pow(2).mean().sqrt() / rows[:, :r].pow(2).mean().sqrt()
    assert err < 0.15                                          # E2M1 with 16-blocks: about 8-10% RMS
    torch.testing.assert_close(decoded[:, r:], rows[:, r:], rtol=0.07, atol=gs * 2 ** -9)   # e4m3


def test_record_bytes_are_the_planners():
    for preset in ("kimi-k3", "k3-tiny"):
        cfg = K3Config.preset(preset)
        assert nvfp4_latent_record_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim) == latent_record_bytes(cfg, "nvfp4")
    assert latent_record_bytes(K3Config.preset("kimi-k3"), "nvfp4") == 352
    with pytest.raises(ValueError, match="% 16"):
        nvfp4_latent_record_bytes(40, 8)
