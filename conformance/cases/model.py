"""The end-to-end model: the platform's kernels (`Platform.build_model`, the loader,
`k3_process_weights`) against the reference kernels, on tiny random checkpoints made on the fly.
The platform model runs on the engine's packed cache as the platform allocates it
(`k3_allocate_cache`, KDA state rows in its `k3_kda_state_layout`): row-strided views, state
rows and pages sharing one row space. The reference runs on a pool of its own (torch's
memory, canonical state layout, other rows), both through the engine's ModelRunner.

- model.greedy: three requests of different lengths (one longer than K3.1 Pro tiny's DSA
  top-16) generate greedily with the reference kernels (whole-prompt prefill, one batch); the
  platform model is fed the same tokens with chunked prefill (7 tokens a call, mixed with
  decode steps, one-token steps first as the engine orders them), other state rows and a
  different page shuffle. In float64 the reference is
  the oracle: the platform's argmax must equal its token at every step where its top-1 / top-2
  gap exceeds ~0, and the logits must agree to ~1e-8. In a rounding dtype the same-dtype
  reference is itself an approximation (a fused kernel that skips an intermediate rounding is
  more accurate than it, not wrong), so the platform is judged against the float64 oracle fed
  the same tokens, relative to the same-dtype reference: (1) its logits' error ratio against
  the oracle may not exceed 1.5x the reference's own (plus a small floor), and (2) at every
  step where the oracle's top-1 / top-2 gap exceeds the dtype's margin, its argmax must be the
  oracle's token or the same-dtype reference's (the first divergence is named). bf16's margin
  is 4 logits: measured bf16 tiny models, the reference ops included, flip tokens at oracle
  gaps up to ~4 (random routers have near-ties that bf16 rounding flips).
- model.batch_invariance: a request's tokens and logits alone equal those it gets in a batch
  with two other requests (other slots, other pages), within the same margins.
- model.graph_decode (platforms with `graph_capture`): the same three requests with their pure
  decode steps replayed from graphs the platform's `k3_graph_runner` captured (buckets 2 and
  4: the three-request steps pad one sequence onto a scratch row) give the tokens and logits
  of eager decode on the same platform.
"""

from __future__ import annotations

import torch

from k3.checkpoint.loader import load_checkpoint
from k3.config import K3Config
from k3.model import K3ForCausalLM

from .. import compare as cmp
from ..driver import Request, prompts, run, tiny_checkpoint, top2_gap
from ..inputs import TORCH_DTYPES
from ..registry import Case, Sample, Tolerance, register

PRESETS = ("k3-tiny", "k3.1-pro-tiny", "kimi-linear-tiny")
STEPS, CHUNK, LENGTHS = 8, 7, [24, 9, 40]
# a step is compared when the reference's top-1 / top-2 logit gap exceeds this (logit std ~ 8)
MARGINS = {"float64": 1e-6, "float32": 0.5, "bfloat16": 2.0}
# logits: the oracle in float64; a guard against garbage in the rounding dtypes (tokens decide)
LOGIT_TOL = {"float64": Tolerance(1e-8, 1e-9), "float32": Tolerance(0.25, 0.5), "bfloat16": Tolerance(0.5, 1.0)}
# model.greedy in a rounding dtype, against the float64 oracle fed the same tokens: a step is
# compared when the oracle's top-1 / top-2 gap exceeds this, and the platform's logits error
# ratio may reach ORACLE_ERROR_GROWTH x the same-dtype reference's, plus ORACLE_ERROR_FLOOR
ORACLE_MARGINS = {"float32": 0.5, "bfloat16": 4.0}
ORACLE_ERROR_GROWTH, ORACLE_ERROR_FLOOR = 1.5, {"float32": 1e-5, "bfloat16": 0.01}


def _platform_model(ctx, preset: str, dtype: torch.dtype):
    key = ("platform-model", preset, dtype)
    if key not in ctx.cache:
        path = tiny_checkpoint(ctx.workdir, preset)
        model = ctx.platform.build_model(K3Config.from_pretrained(path), dtype=dtype)
        load_checkpoint(model, path, progress=False)
        ctx.platform.process_weights(model)
        ctx.cache[key] = model
    return ctx.cache[key]


def _reference_traces(ctx, preset: str, dtype: torch.dtype, seed: int):
    key = ("reference-traces", preset, dtype, seed)
    if key not in ctx.cache:
        path = tiny_checkpoint(ctx.workdir, preset)
        model = K3ForCausalLM(K3Config.from_pretrained(path), dtype=dtype)
        load_checkpoint(model, path, progress=False)
        ctx.cache[key] = run(model, [Request(p) for p in prompts(seed, LENGTHS)], steps=STEPS, chunk=None,
                             slots=[0, 1, 2], seed=seed)
    return ctx.cache[key]


def compare_tokens(name: str, got: list, want: list, margin: float) -> tuple[cmp.OutputResult, str]:
    """got / want: Traces per request; want's logits give the gaps. Returns the result and a note."""
    compared = near_ties = diverged = 0
    first = ""
    for r, (g, w) in enumerate(zip(got, want)):
        gaps = top2_gap(w.stacked())
        for step, (token, logits) in enumerate(zip(w.tokens, g.logits)):
            if gaps[step] <= margin:
                near_ties += 1
                continue
            compared += 1
            mine = int(logits.argmax())
            if mine != token:
                diverged += 1
                first = first or (f"request {r} step {step}: platform token {mine} != reference {token} "
                                  f"(reference gap {gaps[step]:.3g} > margin {margin:g})")
    note = f"{name}: compared {compared} steps, {near_ties} near-tie step(s) (gap <= {margin:g}) not compared"
    result = cmp.OutputResult(name, "tokens", diverged == 0, diverged / max(compared, 1), None,
                              Tolerance(0.0, 0.0), first)
    return result, note


def _oracle_traces(ctx, preset: str, seed: int, tokens: list[list[int]], key) -> list:
    """The float64 reference fed `tokens` (each request's forced tokens): the oracle's logits at
    every step of a rounding-dtype run."""
    key = ("oracle-traces", preset, seed, key)
    if key not in ctx.cache:
        path = tiny_checkpoint(ctx.workdir, preset)
        model = K3ForCausalLM(K3Config.from_pretrained(path), dtype=torch.float64)
        load_checkpoint(model, path, progress=False)
        requests = [Request(p, forced=t) for p, t in zip(prompts(seed, LENGTHS), tokens)]
        ctx.cache[key] = run(model, requests, steps=STEPS, chunk=None, slots=[0, 1, 2], seed=seed)
    return ctx.cache[key]


def compare_tokens_to_oracle(name: str, got: list, same_dtype: list, oracle: list,
                             margin: float) -> tuple[cmp.OutputResult, str]:
    """got / same_dtype / oracle: Traces per request, fed the same tokens. At each step where
    the oracle's top-1 / top-2 gap exceeds `margin`, got's argmax must be the oracle's argmax or
    the same-dtype reference's token."""
    compared = near_ties = diverged = 0
    first = ""
    for r, (g, w, o) in enumerate(zip(got, same_dtype, oracle)):
        truth = o.stacked()
        gaps = top2_gap(truth)
        for step, (logits, reference_token) in enumerate(zip(g.logits, w.tokens)):
            if gaps[step] <= margin:
                near_ties += 1
                continue
            compared += 1
            mine, best = int(logits.argmax()), int(truth[step].argmax())
            if mine not in (best, reference_token):
                diverged += 1
                first = first or (f"request {r} step {step}: platform token {mine}, float64 oracle {best} (gap "
                                  f"{gaps[step]:.3g} > margin {margin:g}), same-dtype reference {reference_token}")
    note = (f"{name}: compared {compared} steps with the float64 oracle, {near_ties} near-tie step(s) "
            f"(oracle gap <= {margin:g}) not compared")
    result = cmp.OutputResult(name, "tokens", diverged == 0, diverged / max(compared, 1), None,
                              Tolerance(0.0, 0.0), first)
    return result, note


def compare_error_to_oracle(name: str, got: torch.Tensor, same_dtype: torch.Tensor, oracle: torch.Tensor,
                            dtype: str) -> cmp.OutputResult:
    """got's error ratio against the oracle may not exceed the same-dtype reference's by more
    than ORACLE_ERROR_GROWTH x, plus the dtype's floor."""
    mine, _, problem = cmp.error_stats(got, oracle)
    theirs, _, _ = cmp.error_stats(same_dtype, oracle)
    allowed = ORACLE_ERROR_GROWTH * theirs + ORACLE_ERROR_FLOOR[dtype]
    message = problem or ("" if mine <= allowed else
                          f"error ratio {mine:.3g} against the float64 oracle > {ORACLE_ERROR_GROWTH:g} x the "
                          f"same-dtype reference's {theirs:.3g} + {ORACLE_ERROR_FLOOR[dtype]:g}")
    return cmp.OutputResult(name, "close", not message, mine, None, Tolerance(allowed, 0.0), message)


def _logits(traces) -> torch.Tensor:
    return torch.cat([t.stacked() for t in traces])


def _greedy(ctx, item):
    preset, dtype, seed = item.sample.params["preset"], TORCH_DTYPES[item.dtype], item.seed % 1000
    want = _reference_traces(ctx, preset, dtype, seed)
    model = _platform_model(ctx, preset, dtype)
    requests = [Request(p, forced=t.tokens) for p, t in zip(prompts(seed, LENGTHS), want)]
    got = run(model, requests, steps=STEPS, chunk=CHUNK, slots=[2, 0, 1], device=ctx.device, seed=seed + 1,
              platform=ctx.platform)
    if item.dtype == "float64":
        tokens, note = compare_tokens("tokens", got, want, MARGINS[item.dtype])
        logits = cmp.close("logits", _logits(got), _logits(want), LOGIT_TOL[item.dtype])
        return cmp.Outcome([tokens, logits], [note])
    oracle = _oracle_traces(ctx, preset, seed, [t.tokens for t in want], key=item.dtype)
    tokens, note = compare_tokens_to_oracle("tokens", got, want, oracle, ORACLE_MARGINS[item.dtype])
    accuracy = compare_error_to_oracle("logits_vs_float64", _logits(got), _logits(want), _logits(oracle), item.dtype)
    garbage_guard = cmp.close("logits", _logits(got), _logits(want), LOGIT_TOL[item.dtype])
    return cmp.Outcome([tokens, accuracy, garbage_guard], [note])


def _batch_invariance(ctx, item):
    preset, dtype, seed = item.sample.params["preset"], TORCH_DTYPES[item.dtype], item.seed % 1000
    model = _platform_model(ctx, preset, dtype)
    a, b, c = prompts(seed, LENGTHS)
    alone = run(model, [Request(a)], steps=STEPS, chunk=CHUNK, slots=[0], device=ctx.device, seed=seed,
                platform=ctx.platform)
    batch = run(model, [Request(b), Request(a, forced=alone[0].tokens), Request(c)], steps=STEPS, chunk=CHUNK,
                slots=[3, 1, 0], device=ctx.device, seed=seed + 1, platform=ctx.platform)
    tokens, note = compare_tokens("tokens", [batch[1]], alone, MARGINS[item.dtype])
    logits = cmp.close("logits", batch[1].stacked(), alone[0].stacked(), LOGIT_TOL[item.dtype])
    return cmp.Outcome([tokens, logits], [note])


def _graph_decode(ctx, item):
    preset, dtype, seed = item.sample.params["preset"], TORCH_DTYPES[item.dtype], item.seed % 1000
    if ctx.platform.graph_runner is None:
        raise RuntimeError(f"platform {ctx.platform.name!r} claims graph_capture but its k3_graph_runner returns "
                           "None: implement the hook or drop the capability")
    model = _platform_model(ctx, preset, dtype)
    kw = dict(steps=STEPS, chunk=CHUNK, slots=[2, 0, 1], device=ctx.device, seed=seed, platform=ctx.platform)
    eager = run(model, [Request(p) for p in prompts(seed, LENGTHS)], **kw)
    forced = [Request(p, forced=t.tokens) for p, t in zip(prompts(seed, LENGTHS), eager)]
    replayed = run(model, forced, graph_buckets=[2, 4], **kw)
    tokens, note = compare_tokens("tokens", replayed, eager, MARGINS[item.dtype])
    logits = cmp.close("logits", _logits(replayed), _logits(eager), LOGIT_TOL[item.dtype])
    return cmp.Outcome([tokens, logits], [note])


# model.greedy also runs k3-tiny with experts that divide into MXFP4 tiles, so a platform that
# repacks them tile-major at load (nvidia's moe_experts_bf16) serves that layout in a model case
GREEDY_PRESETS = (*PRESETS, "k3-tiny-tiles")


def _samples(presets=PRESETS):
    return tuple(Sample(f"{p}_prompts{'-'.join(map(str, LENGTHS))}_chunk{CHUNK}_gen{STEPS}", params={"preset": p})
                 for p in presets)


register(Case(
    "model.greedy", "model", "model.greedy", run=_greedy, dtypes=("float64", "float32", "bfloat16"),
    smoke_dtype="float32", samples=_samples(GREEDY_PRESETS),
    doc="Greedy tokens of the platform's kernels equal the reference kernels' (chunked prefill)."))

register(Case(
    "model.batch_invariance", "model", "model.batch_invariance", run=_batch_invariance,
    dtypes=("float64", "float32", "bfloat16"), smoke_dtype="float32", samples=_samples(),
    doc="A request's greedy tokens do not change with its batch company."))

register(Case(
    "model.graph_decode", "model", "model.graph_decode", run=_graph_decode, requires=("graph_capture",),
    dtypes=("float32", "bfloat16"), smoke_dtype="float32", samples=_samples(),
    doc="Decode steps replayed from the platform's captured graphs equal eager decode."))
