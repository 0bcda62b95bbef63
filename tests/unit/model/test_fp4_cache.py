"""FP4 caches end to end on the reference platform: NVFP4 latents (`k3.quant.nvfp4_latent`) and
MXFP4 DSA index keys, written on store and read dequantised, against the same model over a
bf16 cache; and the pool's bytes per token against the planner's (`k3 plan`)."""

import pytest
import torch

import k3
from k3.cache.format import CacheFormat
from k3.cache.pool import CachePool
from k3.cache.records import attention_bytes_per_token
from k3.config import K3Config

FP4 = {"kv_cache_dtype": "nvfp4", "index_cache_dtype": "mxfp4"}


def _pool_bytes_per_token(pool: CachePool) -> int:
    """Bytes the pool's latent and index-key views span per token (what kernels can address)."""
    block, views = pool.format.block_size, pool.views
    total = sum(v.pages[0].numel() * v.pages.element_size() for v in views.latent)
    for v in views.index_keys or []:
        total += v.values[0].numel() * v.values.element_size() + v.scales[0].numel() * v.scales.element_size()
    return total // block


@pytest.mark.parametrize("preset, want", [("kimi-k3.1-pro", 10_080), ("k3.1-pro-tiny", None), ("k3-tiny", None)])
def test_pool_bytes_per_token_equal_the_planner(preset, want):
    cfg = K3Config.preset(preset)
    planned = attention_bytes_per_token(cfg, **FP4)
    assert want is None or planned == want
    fmt = CacheFormat.build(cfg, activation_dtype=torch.bfloat16, block_size=64, **FP4)
    pool = CachePool(cfg, fmt, 2, device="meta")              # real dims, no memory
    assert _pool_bytes_per_token(pool) == planned
    layout = fmt.layout(cfg)
    regions = {r.name: r.nbytes for r in layout.attention_regions}
    assert sum(regions.values()) == 64 * planned              # the row holds exactly the planned records


def test_llm_serves_fp4_caches_close_to_the_bf16_cache(tiny_checkpoint):
    """`k3.LLM(kv_cache_dtype="nvfp4", index_cache_dtype="mxfp4")` on k3.1-pro-tiny (DSA: top-16
    of a 40-token prompt): the prompt's teacher-forced logprobs (every latent and index key
    written, then read back dequantised; then greedy decoding) stay within 20% RMS of the bf16
    cache's, relative to their mean size. Measured on this random model, whose logprobs are
    about -27 nats and very sensitive: fp4 0.10, fp8 latents 0.025, MXFP4 keys alone 0.09 (a
    flipped top-16 selection moves a logprob by nats); a misplaced or unread record gives NaN."""
    ckpt = str(tiny_checkpoint("k3.1-pro-tiny"))
    prompt = [{"prompt_token_ids": [(7 * i) % 300 + 1 for i in range(40)]}]
    params = k3.SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0)
    outs = {}
    for opts in ({"kv_cache_dtype": "bf16"}, FP4):
        llm = k3.LLM(ckpt, dtype="bfloat16", kv_cache_memory_gib=0.02, load_progress=False, **opts)
        outs[opts["kv_cache_dtype"]] = llm.generate(prompt, params, use_tqdm=False)[0]
    ids = prompt[0]["prompt_token_ids"]

    def logprobs(out):
        return torch.tensor([p[t].logprob for p, t in zip(out.prompt_logprobs[1:], ids[1:])])

    want, got = logprobs(outs["bf16"]), logprobs(outs["nvfp4"])
    assert torch.isfinite(got).all()
    err = (got - want).pow(2).mean().sqrt().item()                 # nats
    assert err / want.abs().mean().item() < 0.2, (err, want.abs().mean().item())
    tokens = outs["nvfp4"].outputs[0].token_ids
    assert len(tokens) == 3 and all(0 <= t < 163840 for t in tokens)
