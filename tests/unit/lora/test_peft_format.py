"""PEFT adapter files: what k3 accepts, and the named errors of what it does not; the registry's
slots (reuse after unload, no free slot, duplicate names)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.config import K3Config
from k3.lora import LoRAError, LoRAFormatError, LoRANotFound, LoRARegistry, read_peft_adapter
from k3.model import K3ForCausalLM
from k3.model.lora import attach_lora

from lora_files import write_adapter

Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def meta_model():
    return K3ForCausalLM(K3Config.preset("k3-tiny"), device="meta")


@pytest.fixture
def adapter(tmp_path, meta_model):
    return write_adapter(tmp_path / "a", meta_model, rank=4, every=7)


def _targets(model):
    from k3.model.lora import lora_targets_of

    return lora_targets_of(model)


def test_a_peft_adapter_reads_with_its_scale(adapter, meta_model):
    read = read_peft_adapter(adapter, _targets(meta_model), max_rank=8)
    assert read.rank == 4 and read.scale == 2.0              # lora_alpha 8 / r 4
    written = load_file(str(adapter / "adapter_model.safetensors"))
    assert 2 * len(read.weights) == len(written) > 0
    for (target, expert), (a, b) in read.weights.items():      # each pair back under its PEFT names
        module = target if expert is None else target.replace("{expert}", str(expert))
        assert torch.equal(a, written[f"base_model.model.{module}.lora_A.weight"])
        assert torch.equal(b, written[f"base_model.model.{module}.lora_B.weight"])
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "use_rslora": True}))
    assert read_peft_adapter(adapter, _targets(meta_model), max_rank=8).scale == 4.0   # 8 / sqrt(4)


def _rewrite(adapter, change):
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))


@pytest.mark.parametrize("case, match", [
    ("shape", r"tensor 'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight' must be \[4, 64\]"),
    ("unknown", r"no adaptable module 'model\.layers\.0\.self_attn\.nope_proj'"),
    ("missing_b", r"q_proj\.lora_B\.weight is missing"),
    ("expert", r"expert 8 is not below 8"),
    ("name", r"is not a PEFT LoRA weight"),
])
def test_bad_tensors_are_named_with_the_expected_shape(adapter, meta_model, case, match):
    def change(t):
        t[f"{Q}.lora_A.weight"] = torch.zeros(4, 64, dtype=torch.bfloat16)
        t[f"{Q}.lora_B.weight"] = torch.zeros(64, 4, dtype=torch.bfloat16)   # layer 0 is KDA: 4 heads x 16
        if case == "shape":
            t[f"{Q}.lora_A.weight"] = torch.zeros(4, 63, dtype=torch.bfloat16)
        elif case == "unknown":
            t[f"{Q.replace('q_proj', 'nope_proj')}.lora_A.weight"] = torch.zeros(4, 64)
        elif case == "missing_b":
            del t[f"{Q}.lora_B.weight"]
        elif case == "expert":
            t["base_model.model.model.layers.1.block_sparse_moe.experts.8.w1.lora_A.weight"] = torch.zeros(4, 32)
        elif case == "name":
            t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    _rewrite(adapter, change)
    with pytest.raises(LoRAFormatError, match=match):
        read_peft_adapter(adapter, _targets(meta_model), max_rank=8)


def test_bad_configs_are_refused(adapter, meta_model, tmp_path):
    targets = _targets(meta_model)
    with pytest.raises(LoRAFormatError, match="rank 4 is above max_lora_rank 2"):
        read_peft_adapter(adapter, targets, max_rank=2)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LoRAFormatError, match="use_dora"):
        read_peft_adapter(adapter, targets, max_rank=8)
    (adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAFormatError, match="not JSON"):
        read_peft_adapter(adapter, targets, max_rank=8)
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(LoRAFormatError, match="no adapter_config.json"):
        read_peft_adapter(adapter, targets, max_rank=8)
    with pytest.raises(LoRAFormatError, match="not a folder"):
        read_peft_adapter(tmp_path / "absent", targets, max_rank=8)


def test_registry_slots(tmp_path):
    model = K3ForCausalLM(K3Config.preset("k3-tiny"), dtype=torch.float32, device="cpu")
    running: set[int] = set()
    registry = LoRARegistry(attach_lora(model, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu"),
                            in_use=lambda: running)
    folders = [write_adapter(tmp_path / n, model, rank=2, every=9, seed=i) for i, n in enumerate("abc")]
    a, b = registry.load("a", folders[0]), registry.load("b", folders[1])
    assert (a.slot, b.slot) == (0, 1) and a.salt != b.salt
    with pytest.raises(LoRAError, match="already been loaded"):
        registry.load("a", folders[0])
    with pytest.raises(LoRAError, match="every one of the 2 LoRA slots"):
        registry.load("c", folders[2])
    registry.unload("a")
    running.add(0)                     # a request still runs on a's slot: it is not reused yet
    with pytest.raises(LoRAError, match="every one of the 2 LoRA slots"):
        registry.load("c", folders[2])
    running.clear()
    c = registry.load("c", folders[2])
    assert c.slot == 0 and registry.state.scales[0] == 1.0 * 8 / 2
    with pytest.raises(LoRANotFound):
        registry.unload("a")
    again = registry.load("a", folders[0]) if registry.unload("b") else None
    assert again.slot == 1 and again.salt != a.salt          # a new load never shares a's cached prefixes
