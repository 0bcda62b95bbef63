"""LoRA on the model graph (k3-tiny, float64): an adapter's logits equal those of the model
whose weights were merged W + scale B A (the independent computation of `lora_files`), on every
attention projection, MLP and MXFP4 routed expert; a batch mixing two adapters and the base
model gives every row its own logits, on the prefill, decode and mixed paths."""

from __future__ import annotations

import pytest
import torch

from k3.checkpoint.loader import load_model
from k3.lora import LoRARegistry
from k3.model.lora import attach_lora, lora_targets_of
from k3.reference.lora import lora_delta

from lora_files import merge_adapter, teacher_forced_lora, write_adapter
from model_runs import teacher_forced


def test_every_attention_projection_and_expert_is_a_target():
    """KDA q/k/v/g/o, MLA q_a/q_b/kv_a/kv_b/o and its gate, and every expert's w1/w3/w2 of
    k3-tiny (layer 4 is KDA, 3 MLA, 1 MoE) are adaptable, under the names PEFT writes."""
    from k3.config import K3Config
    from k3.model import K3ForCausalLM

    targets = lora_targets_of(K3ForCausalLM(K3Config.preset("k3-tiny"), device="meta"))
    kda = {f"model.layers.4.self_attn.{p}_proj" for p in "qkvgo"}
    mla = {f"model.layers.3.self_attn.{p}" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                     "o_proj", "g_proj")}
    experts = {f"model.layers.1.block_sparse_moe.experts.{{expert}}.{w}" for w in ("w1", "w2", "w3")}
    assert kda | mla | experts <= targets.keys()
    w3 = targets["model.layers.1.block_sparse_moe.experts.{expert}.w3"]
    assert (w3.experts, w3.in_features, w3.out_features, w3.rows) == (8, 32, 32, slice(32, 64))   # MXFP4 w13's up half


def test_lora_delta_leaves_rows_without_an_adapter_untouched():
    g = torch.Generator().manual_seed(0)
    x, a, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((5, 6), (2, 3, 6), (2, 4, 3)))
    scales = torch.tensor([0.5, 2.0], dtype=torch.float64)
    idx = torch.tensor([1, -1, 0, -1, 1])
    got = lora_delta(x, a, b, scales, idx)
    for t, s in enumerate(idx.tolist()):
        want = torch.zeros(4, dtype=torch.float64) if s < 0 else scales[s] * b[s] @ (a[s] @ x[t])
        torch.testing.assert_close(got[t], want, rtol=0, atol=1e-12)
    assert torch.equal(got[1], torch.zeros(4, dtype=torch.float64))


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint("k3-tiny")
    model = load_model(ckpt, dtype=torch.float64, progress=False)
    registry = LoRARegistry(attach_lora(model, max_loras=2, max_rank=8, dtype=torch.float64, device="cpu"))
    root = tmp_path_factory.mktemp("adapters")
    a = write_adapter(root / "a", model, rank=4, seed=1)                  # every target
    b = write_adapter(root / "b", model, rank=8, seed=2, every=2)         # every other target, rank 8
    registry.load("a", a)
    registry.load("b", b)
    return ckpt, model, registry, a, b


def test_mixed_batch_equals_merged_weights_and_each_row_alone(setup):
    """Prompts of 4, 9 and 6 tokens in chunks of 3 on adapter a, adapter b and the base model:
    the second call is MIXED (prompt 0's last token decodes beside the others' chunks, and
    MLA's kv_b_proj runs per adapter run). Every logit equals the merged model's and the row's
    own run alone."""
    ckpt, model, registry, a, b = setup
    slots = [registry.get("a").slot, registry.get("b").slot, -1]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (4, 9, 6)]
    mixed = teacher_forced_lora(model, prompts, slots, chunk=3)
    base = load_model(ckpt, dtype=torch.float64, progress=False)
    for prompt, slot, folder, got in zip(prompts, slots, (a, b, None), mixed):
        reference = load_model(ckpt, dtype=torch.float64, progress=False) if folder else base
        if folder:
            merge_adapter(reference, folder)
        want = teacher_forced(reference, [prompt])[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
        alone = teacher_forced_lora(model, [prompt], [slot])[0]
        torch.testing.assert_close(got, alone, rtol=0, atol=1e-9)
    effect = (mixed[0] - teacher_forced(base, [prompts[0]])[0]).abs().max()
    assert effect > 1e-2, "the adapter must change the logits for the comparison to mean anything"


def test_a_decode_step_on_an_adapter_matches_the_merged_model(setup):
    """Token by token (the fused KDA decode step and MLA's absorbed decode with the merged kv_b)."""
    ckpt, model, registry, a, _ = setup
    prompt = list(range(5, 10))
    got = teacher_forced_lora(model, [prompt, prompt], [registry.get("a").slot, -1], chunk=1)
    merged = load_model(ckpt, dtype=torch.float64, progress=False)
    merge_adapter(merged, a)
    torch.testing.assert_close(got[0], teacher_forced(merged, [prompt], chunk=1)[0], rtol=0, atol=1e-9)
    torch.testing.assert_close(got[1], teacher_forced(load_model(ckpt, dtype=torch.float64, progress=False),
                                                      [prompt], chunk=1)[0], rtol=0, atol=1e-9)
