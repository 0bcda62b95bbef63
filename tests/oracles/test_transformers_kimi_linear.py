"""k3's float64 Kimi-Linear graph against HF transformers' own `kimi_linear` model.

For each shape of `hf_kimi_linear.SHAPES`, transformers writes the checkpoint (its
`save_pretrained`, its names and layout, its config.json) and k3 loads it unchanged through
`k3.LLM`. Compared, on prompts of 5, 23 and 70 tokens (70 > 64: transformers' chunked KDA runs
two chunks):

- log-probabilities at every prompt position (k3's `prompt_logprobs`: the prompt token and the
  top 5) against transformers' teacher-forced forward;
- k3's greedy continuation, token for token, against transformers' argmax on the same tokens,
  and against transformers' own decode path (`generate` with its cache), each until the first
  near-tie in transformers' logits (DESIGN.md "Testing equality");
- the log-probabilities k3 reports for its generated tokens against transformers' decode steps.

transformers rounds its RMSNorms, KDA gate and recurrence and MoE router to float32 inside a
float64 model (its design, kept): the tolerances below admit that rounding (observed <= 2.3e-5
on the log-probabilities). One known difference is patched for these comparisons: the eps of the
MLA q_a_layernorm / kv_a_layernorm (transformers 1e-6, k3 and vLLM rms_norm_eps = 1e-5);
`test_mla_norm_eps_difference_is_small` measures what it changes without the patch.

Run in the peer venv: `/work/scratch/vllm-venv/bin/python -m pytest -q
tests/oracles/test_transformers_kimi_linear.py -p no:cacheprovider`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

pytestmark = pytest.mark.oracle
pytest.importorskip("transformers.models.kimi_linear",
                    reason="needs transformers with kimi_linear (the peer venv, .ci/peers.sh)")

import hf_kimi_linear as hf  # noqa: E402  (beside this file; tests/oracles/conftest.py)

PROMPT_LENGTHS = (5, 23, 70)
NEW_TOKENS = 16
TOP_N = 5
LOGPROB_TOL = 1e-4      # |k3 - transformers| of a log-probability: transformers' fp32 internals round at ~1e-5
MARGIN = 1e-3           # top-1 minus top-2 logit below this (~100x that rounding): a near-tie, comparison stops
EPS_REL_TOL = 1e-4      # what the MLA norm eps changes, relative to the largest logit
UNPATCHED_TOL = 1e-3    # |k3 - transformers| of a log-probability with transformers' MLA norm eps (observed <= 1.1e-4)


@dataclass
class Run:
    """One shape: transformers' model (float64), k3's outputs on the prompts."""

    name: str
    path: Path
    model: object
    prompts: list[list[int]]
    outputs: list                  # k3 RequestOutputs


@pytest.fixture(scope="module", params=list(hf.SHAPES))
def run(request, tmp_path_factory) -> Run:
    import k3

    name = request.param
    path = tmp_path_factory.mktemp(name)
    model = hf.write_checkpoint(name, path, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf.VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    llm = k3.LLM(model=str(path), dtype="float64", platform="reference", skip_tokenizer_init=True,
                 kv_cache_memory_gib=0.05, load_progress=False)
    params = k3.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0,
                               prompt_logprobs=TOP_N)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return Run(name, path, model, prompts, outputs)


def _patched(run: Run):
    """transformers' MLA norms with k3's eps (the one known difference)."""
    return hf.mla_norm_eps(run.model, json.loads((run.path / "config.json").read_text())["rms_norm_eps"])


def _prompt_logprob_diff(run: Run) -> tuple[float, str]:
    """Largest |k3 - transformers| over every prompt position's reported log-probabilities."""
    worst, where = 0.0, ""
    for prompt, out in zip(run.prompts, run.outputs):
        lp = torch.log_softmax(hf.forward_logits(run.model, prompt), -1)             # [T, V]
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for p, entry in enumerate(out.prompt_logprobs[1:]):                          # position p scores p + 1
            assert prompt[p + 1] in entry and len(entry) >= TOP_N
            for token, value in entry.items():
                d = abs(value.logprob - lp[p, token].item())
                if d > worst:
                    worst, where = d, f"prompt of {len(prompt)}, position {p}, token {token}"
    return worst, where


def test_the_checkpoint_is_transformers_own(run):
    """What k3 loaded is transformers' format: flat KDA fields, and its names for the shape."""
    raw = json.loads((run.path / "config.json").read_text())
    assert "linear_attn_config" not in raw and "layer_types" in raw and "linear_head_dim" in raw
    names = set()
    for shard in run.path.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            names |= set(f.keys())
    runtime = not hf.SHAPES[run.name][1]
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names) == runtime
    assert any(n.endswith("self_attn.conv1d.weight") for n in names) == runtime


def test_prompt_logprobs_match_transformers(run):
    with _patched(run):
        worst, where = _prompt_logprob_diff(run)
    assert worst < LOGPROB_TOL, f"{run.name}: max |k3 - transformers| log-probability {worst:.2e} at {where}"
    print(f"{run.name}: max |k3 - transformers| prompt log-probability {worst:.2e} (eps patched)")


def test_mla_norm_eps_difference_is_small(run):
    """Without the patch: transformers' MLA norms at eps 1e-6 against k3's rms_norm_eps. The
    difference it makes (transformers against itself, patched or not) is reported and bounded."""
    relative = 0.0
    for prompt in run.prompts:
        plain = hf.forward_logits(run.model, prompt)
        with _patched(run) as count:
            patched = hf.forward_logits(run.model, prompt)
        assert count > 0
        relative = max(relative, ((plain - patched).abs().max() / plain.abs().max()).item())
    worst, where = _prompt_logprob_diff(run)
    assert 0 < relative < EPS_REL_TOL, f"{run.name}: the MLA norm eps changes the logits by {relative:.2e} (relative)"
    assert worst < UNPATCHED_TOL, f"{run.name}: unpatched max |k3 - transformers| log-probability {worst:.2e} at {where}"
    print(f"{run.name}: MLA norm eps 1e-6 vs 1e-5 changes transformers' logits by {relative:.2e} of the largest; "
          f"unpatched max |k3 - transformers| prompt log-probability {worst:.2e}")


def _match_until_near_tie(name: str, expected: torch.Tensor, tokens: list[int], what: str) -> str:
    """Token i of k3 equals the argmax of transformers' logits row i [n, V] while the row's
    top-2 gap is at least MARGIN; returns where the comparison stopped."""
    gaps = hf.top2_gap(expected)
    for i, token in enumerate(tokens):
        if gaps[i] < MARGIN:
            return f"stopped at generated token {i}: near-tie (gap {gaps[i]:.1e})"
        best = int(expected[i].argmax())
        assert best == token, f"{name}: {what} token {i}: transformers {best} (gap {gaps[i]:.2e}), k3 {token}"
    return f"all {len(tokens)} tokens compared (smallest gap {gaps.min():.1e})"


def test_greedy_continuation_matches_teacher_forced(run):
    with _patched(run):
        for prompt, out in zip(run.prompts, run.outputs):
            tokens = out.outputs[0].token_ids
            assert len(tokens) == NEW_TOKENS
            logits = hf.forward_logits(run.model, prompt + tokens)[len(prompt) - 1: -1]      # row i -> token i
            said = _match_until_near_tie(run.name, logits, tokens, "teacher-forced")
            print(f"{run.name}, prompt of {len(prompt)}: {said}")


def test_transformers_decode_path_matches_k3(run):
    """transformers' generate (its cache: conv state update, recurrent KDA, MLA over its cache)
    against k3's greedy tokens and their log-probabilities."""
    with _patched(run):
        for prompt, out in zip(run.prompts, run.outputs):
            k3_tokens = out.outputs[0].token_ids
            tokens, logits = hf.generate(run.model, prompt, NEW_TOKENS)
            said = _match_until_near_tie(run.name, logits, k3_tokens, "decode")
            lp = torch.log_softmax(logits, -1)
            agree = next((i for i, (a, b) in enumerate(zip(tokens, k3_tokens)) if a != b), len(tokens))
            for i in range(agree):
                k3_lp = out.outputs[0].logprobs[i][k3_tokens[i]]
                assert abs(k3_lp - lp[i, tokens[i]].item()) < LOGPROB_TOL, (run.name, len(prompt), i)
            print(f"{run.name}, prompt of {len(prompt)}: decode path {said}")
