"""fp8 latents in AMD gfx942's flavour (E4M3FNUZ, what its matrix cores take) end to end on the
simulated gfx942 platform (K3_AMD_SIMULATE, reference ops: the Triton MLA kernels take OCP
pages only): the pool lays out FNUZ pages when the platform's capabilities say so, the model
writes and reads them through the codecs, and the logprobs stay close to the bf16 cache's."""

import pytest
import torch

import k3
from k3.cache.format import CacheFormat
from k3.cache.pool import CachePool
from k3.config import K3Config
from k3.platform import select_platform


@pytest.fixture
def gfx942(monkeypatch):
    monkeypatch.setenv("K3_AMD_SIMULATE", "gfx942")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)        # reference ops (no interpreted kernels)
    return select_platform("amd")


def test_pool_lays_out_the_platforms_fp8_flavour(gfx942):
    cfg = K3Config.preset("k3.1-pro-tiny")
    for platform, want in ((gfx942, torch.float8_e4m3fnuz), (select_platform("reference"), torch.float8_e4m3fn)):
        fmt = CacheFormat.build(cfg, activation_dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=64,
                                platform=platform)
        views = CachePool(cfg, fmt, 2, device="meta").views
        assert {v.pages.dtype for v in views.latent} == {want} and all(v.scale is not None for v in views.latent)


def test_llm_serves_fnuz_latents_close_to_the_bf16_cache(gfx942, tiny_checkpoint):
    """k3.1-pro-tiny's teacher-forced prompt logprobs with FNUZ fp8 latents on the simulated
    gfx942 against the bf16 cache on the reference platform: within 10% RMS of their mean size
    (OCP fp8 latents measure 0.025 on this model, tests/unit/model/test_fp4_cache.py); a
    misread record gives NaN or nats of error."""
    ckpt = str(tiny_checkpoint("k3.1-pro-tiny"))
    prompt = [{"prompt_token_ids": [(7 * i) % 300 + 1 for i in range(40)]}]
    params = k3.SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0)
    outs = {}
    for platform, kv in (("reference", "bf16"), ("amd", "fp8")):
        llm = k3.LLM(ckpt, platform=platform, dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory_gib=0.02,
                     load_progress=False)
        outs[kv] = llm.generate(prompt, params, use_tqdm=False)[0]
    ids = prompt[0]["prompt_token_ids"]

    def logprobs(out):
        return torch.tensor([p[t].logprob for p, t in zip(out.prompt_logprobs[1:], ids[1:])])

    want, got = logprobs(outs["bf16"]), logprobs(outs["fp8"])
    assert torch.isfinite(got).all()
    err = (got - want).pow(2).mean().sqrt().item()
    assert err / want.abs().mean().item() < 0.1, (err, want.abs().mean().item())
