"""The vendor plugins: entry points, detection reasons, forcing, capabilities read from the device."""

import importlib
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from k3.platform import PlatformError, discover, select_platform

VENDORS = ("nvidia", "amd", "tpu", "ppu")
VENDOR_HOOKS = ["k3_capabilities", "k3_config_defaults", "k3_conformance_expectations", "k3_detect_platform"]
KERNEL_HOOKS = {"nvidia": ["k3_attn_res_kernels", "k3_collective_backends", "k3_dense_kernels", "k3_elementwise_kernels",
                           "k3_graph_runner", "k3_indexer_kernels", "k3_kda_kernels", "k3_lora_kernels",
                           "k3_mla_kernels", "k3_moe_kernels", "k3_process_weights", "k3_quant_kernels"],
                "ppu": ["k3_attn_res_kernels", "k3_elementwise_kernels", "k3_graph_runner", "k3_indexer_kernels",
                        "k3_kda_kernels", "k3_mla_kernels", "k3_moe_kernels"],
                # tpu: every kernel family, XLA-clean (k3.platforms.xla_kernels.tables), the XLA graph runner, buckets, step end
                "tpu": ["k3_attn_res_kernels", "k3_dense_kernels", "k3_elementwise_kernels", "k3_graph_runner",
                        "k3_indexer_kernels", "k3_kda_kernels", "k3_lora_kernels", "k3_mla_kernels",
                        "k3_moe_kernels", "k3_quant_kernels", "k3_shape_buckets", "k3_step_end"],
                # the portable Triton kernels with AMD launch configurations, the (opt-in) IPC all-gather;
                # no graph runner yet
                "amd": ["k3_attn_res_kernels", "k3_collective_backends", "k3_elementwise_kernels",
                        "k3_indexer_kernels", "k3_kda_kernels", "k3_mla_kernels", "k3_moe_kernels"]}
SDKS = ("triton", "torch_xla", "libtpu", "aiter", "flydsl", "fla", "amdsmi")
CPU_ONLY = torch.version.cuda is None and torch.version.hip is None


def test_vendor_entry_points_are_installed():
    found = {ep.name: ep for ep in entry_points(group="k3")}
    missing = [v for v in VENDORS if v not in found]
    assert not missing, (f"entry points {missing} of group 'k3' not found: reinstall k3 (pip install -e .), and "
                         "delete a stale k3.egg-info in the repository root, which shadows the installed metadata")
    for vendor in VENDORS:
        assert found[vendor].value == f"k3.platforms.{vendor}.plugin" and found[vendor].dist.name == "k3"


@pytest.mark.parametrize("vendor", VENDORS)
def test_plugin_declares_version_and_backs_only_platform_hooks(vendor):
    module = importlib.import_module(f"k3.platforms.{vendor}.plugin")
    assert module.K3_HOOKSPEC_VERSIONS == (1,)
    record = discover(allow=[vendor]).records[vendor]
    assert record.registered and record.distribution == "k3"
    # kernel hooks: NVIDIA's Triton kernels and its symmetric-memory all-reduce, AMD's Triton kernels, tpu's
    # XLA-clean entries, ppu's torch-native ones; every other entry falls back to the reference
    assert record.hooks == sorted(VENDOR_HOOKS + KERNEL_HOOKS.get(vendor, []))
    path = Path(module.k3_conformance_expectations())          # no platform argument: no name check
    assert tomllib.loads(path.read_text())["xfail"] == []


@pytest.mark.skipif(not CPU_ONLY, reason="needs a CPU-only torch build (the CI machine)")
@pytest.mark.parametrize("vendor, words", [
    ("nvidia", ["CPU-only build", "CUDA build of torch", "pip install 'k3[nvidia]'", "triton"]),
    ("amd", ["not a ROCm build", "pip install 'k3[amd]'"]),
    ("tpu", ["torch_xla is not installed", "pip install 'k3[tpu]'", "own environment", "torch 2.9"]),
])
def test_cpu_machine_forcing_a_vendor_is_one_sentence_naming_the_install(vendor, words):
    detection = importlib.import_module(f"k3.platforms.{vendor}.detect").detect()
    assert not detection.available and not detection.forceable
    with pytest.raises(PlatformError) as err:
        select_platform(vendor, env={})
    message = str(err.value)
    assert message.startswith(f"platform '{vendor}' is unavailable: ") and "\n" not in message
    for word in words:
        assert word in message


@pytest.mark.skipif(not CPU_ONLY, reason="needs a CPU-only torch build (the CI machine)")
def test_ppu_is_forceable_on_the_cpu():
    from k3.platforms.ppu.detect import detect

    found = detect()
    assert not found.available and found.forceable and found.device == "cpu" and "--platform ppu" in found.reason
    platform = select_platform("ppu", env={})
    assert platform.info.forced and platform.info.device == "cpu" and platform.info.distribution == "k3"
    assert platform.capabilities.vendor == "t-head" and platform.capabilities.has("bf16")
    from k3.platforms.torch_kernels.native_tables import SERVED

    served = {entry for entry, plugin in platform.kernels.providers.items() if plugin == "ppu"}
    assert served == set(SERVED) and not platform.capabilities.graph_capture and platform.graph_runner is None
    assert platform.config_defaults() == {"gpu_memory_utilization": 0.9, "expert_cache": "auto"}
    assert [p.name for p in platform.conformance_expectations()] == ["conformance.toml"]
    assert platform.records["nvidia"].blocked and not platform.records["reference"].blocked


def test_k3_platform_and_k3_plugins_env():
    assert select_platform(env={"K3_PLATFORM": "ppu"}).name == "ppu"
    platform = select_platform(env={"K3_PLUGINS": "ppu"})
    assert platform.records["nvidia"].reason == "left out by K3_PLUGINS" and not platform.records["nvidia"].registered
    assert platform.records["ppu"].registered and platform.records["reference"].registered
    with pytest.raises(PlatformError, match="unknown platform 'nvidia'"):
        select_platform(env={"K3_PLUGINS": "ppu", "K3_PLATFORM": "nvidia"})


def _fake_torch(monkeypatch, *, cuda=None, hip=None, names=(), props=None):
    import k3.platforms._probe as probe

    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(probe, "cuda_device_names", lambda: list(names))
    if props is not None:
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (props.major, props.minor))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))


def test_nvidia_detection_branches(monkeypatch):
    import k3.platforms._probe as probe
    from k3.platforms.nvidia.detect import detect

    _fake_torch(monkeypatch, hip="6.4")
    assert "ROCm build" in detect().reason
    _fake_torch(monkeypatch, cuda="12.8")
    assert "sees no CUDA device" in detect().reason
    _fake_torch(monkeypatch, cuda="12.8", names=["PPU-ZW810E"])
    assert "T-HEAD PPU" in detect().reason
    h200 = SimpleNamespace(major=9, minor=0, name="NVIDIA H200", total_memory=141 << 30)
    _fake_torch(monkeypatch, cuda="12.8", names=["NVIDIA H200"], props=h200)
    monkeypatch.setattr(probe, "has_module", lambda name: False)
    found = detect()
    assert not found.available and "triton is not installed" in found.reason and "k3[nvidia]" in found.reason
    monkeypatch.setattr(probe, "has_module", lambda name: name == "triton")
    found = detect()
    assert found.available and found.device == "cuda" and "sm_90" in found.reason


def test_ppu_detection_by_device_name(monkeypatch):
    from k3.platforms.ppu.detect import detect, is_ppu_name

    assert is_ppu_name("PPU-ZW810E") and is_ppu_name("T-Head Zhenwu M890") and not is_ppu_name("NVIDIA H200")
    _fake_torch(monkeypatch, cuda="12.8", names=["PPU-ZW810E"])
    found = detect()
    assert found.available and found.device == "cuda" and found.forceable
    _fake_torch(monkeypatch, cuda="12.8", names=["NVIDIA H200"])
    found = detect()
    assert not found.available and found.device == "cuda" and "not a T-HEAD PPU" in found.reason


@pytest.mark.parametrize("major, minor, fp8, fp4", [(8, 0, None, False), (8, 9, "e4m3fn", False),
                                                    (9, 0, "e4m3fn", False), (10, 0, "e4m3fn", True)])
def test_nvidia_capabilities_from_compute_capability(monkeypatch, major, minor, fp8, fp4):
    from k3.platforms.nvidia.capabilities import read

    props = SimpleNamespace(major=major, minor=minor, name="NVIDIA X", total_memory=80 << 30)
    _fake_torch(monkeypatch, cuda="12.8", names=["NVIDIA X"] * 8, props=props)
    caps = read()
    assert caps.arch == f"sm_{major}{minor}" and caps.fp8_dtype == fp8
    assert caps.native_mxfp4 == caps.native_nvfp4 == fp4
    assert caps.graph_capture and caps.device_count == 8 and caps.memory_bytes == 80 << 30 and caps.has("bf16")
    from k3.platforms._probe import has_module

    assert caps.triton == has_module("triton")


@pytest.mark.parametrize("arch, fp8, mxfp4", [("gfx942:sramecc+:xnack-", "e4m3fnuz", False),
                                              ("gfx950", "e4m3fn", True), ("gfx90a", None, False)])
def test_amd_capabilities_from_gfx_arch(monkeypatch, arch, fp8, mxfp4):
    from k3.platforms.amd.capabilities import read

    props = SimpleNamespace(gcnArchName=arch, name="AMD Instinct", total_memory=192 << 30, major=9, minor=4)
    _fake_torch(monkeypatch, hip="6.4", names=["AMD Instinct"], props=props)
    caps = read()
    assert caps.arch == arch.split(":")[0] and caps.fp8_dtype == fp8 and caps.native_mxfp4 == mxfp4
    assert caps.dist_backend == "rccl" and caps.vendor == "amd"
    # nothing implements HIP graphs or the HIP-IPC collective yet: neither is claimed
    assert not caps.graph_capture and not caps.hip_ipc


def test_amd_is_forceable_only_as_a_simulated_target(monkeypatch):
    from k3.platforms.amd import plugin
    from k3.platforms.amd.detect import detect

    _fake_torch(monkeypatch, cuda="12.8", names=["NVIDIA H200"])
    monkeypatch.delenv("K3_AMD_SIMULATE", raising=False)
    assert not detect().forceable
    monkeypatch.setenv("K3_AMD_SIMULATE", "gfx9000")
    found = detect()
    assert not found.forceable and "gfx9000" in found.reason and "gfx942, gfx950" in found.reason
    monkeypatch.setenv("K3_AMD_SIMULATE", "gfx942")
    found = detect()
    assert found.forceable and not found.available and found.device == "cpu" and "simulates gfx942" in found.reason
    info = SimpleNamespace(device="cpu")
    caps = plugin.k3_capabilities(info)
    assert (caps.arch, caps.fp8_dtype, caps.native_mxfp4, caps.graph_capture, caps.hip_ipc) == \
        ("gfx942", "e4m3fnuz", False, False, False)


def test_amd_defaults_follow_the_recipe():
    from k3.platforms.amd import plugin

    assert plugin.k3_config_defaults() == {"max_num_seqs": 16, "gpu_memory_utilization": 0.85}


@pytest.mark.parametrize("pjrt, words, forceable", [("CPU", "PJRT_DEVICE=CPU", True), ("", "libtpu", False),
                                                    ("CUDA", "PJRT_DEVICE=CUDA", False)])
def test_tpu_detection_with_torch_xla_present(monkeypatch, pjrt, words, forceable):
    """PJRT's CPU device makes `--platform tpu` forceable (the CI tier); a TPU is still only
    detected with libtpu and chips."""
    import k3.platforms._probe as probe
    from k3.platforms.tpu.detect import detect

    torch_mm = ".".join(torch.__version__.split(".")[:2])
    monkeypatch.setattr(probe, "dist_version", lambda d: f"{torch_mm}.0" if d in ("torch-xla", "torch_xla") else None)
    monkeypatch.setattr(probe, "has_module", lambda name: name == "torch_xla")
    monkeypatch.setenv("PJRT_DEVICE", pjrt)
    found = detect()
    assert not found.available and words in found.reason and found.device == "xla"
    assert found.forceable == forceable


def test_detection_imports_no_vendor_sdk():
    script = (   # torch itself may import some of them (triton on a CUDA build): only new ones count
        "import sys, importlib, torch, k3.plugin\n"
        f"before = {{m for m in {SDKS!r} if m in sys.modules}}\n"
        f"for v in {VENDORS!r}:\n"
        "    for m in ('detect', 'capabilities', 'plugin'):\n"
        "        importlib.import_module(f'k3.platforms.{v}.{m}')\n"
        f"loaded = [m for m in {SDKS!r} if m in sys.modules and m not in before]\n"
        "assert not loaded, f'imported at module level: {loaded}'\n"
        f"for v in {VENDORS!r}:\n"
        "    importlib.import_module(f'k3.platforms.{v}.detect').detect()\n"
        f"loaded = [m for m in {SDKS!r} if m in sys.modules and m not in before]\n"
        "assert not loaded, f'imported by detection: {loaded}'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_nvidia_backs_the_fused_kda_decode_with_triton(monkeypatch):
    from k3.platforms.nvidia import plugin

    monkeypatch.delenv("K3_NVIDIA_DISABLE", raising=False)
    monkeypatch.delenv("K3_NVIDIA_EXPERIMENTAL", raising=False)
    table = plugin.k3_kda_kernels(batch_invariant=False)
    try:
        import triton  # noqa: F401
    except ImportError:                           # without Triton only the torch kernels serve
        assert table.provided() == ["chunked"]
        return
    assert sorted(table.provided()) == ["chunked", "decode_step", "recurrent", "short_conv"]
    assert table.decode_step.__module__ == "k3.platforms.triton_kernels.kda_decode"
    assert table.recurrent.__module__ == "k3.platforms.triton_kernels.kda_recurrent"


def test_nvidia_serves_the_promoted_kernels_and_takes_out_the_disabled(monkeypatch):
    pytest.importorskip("triton")
    from k3.platforms.nvidia import plugin

    monkeypatch.delenv("K3_NVIDIA_EXPERIMENTAL", raising=False)
    monkeypatch.delenv("K3_NVIDIA_DISABLE", raising=False)
    assert sorted(plugin.k3_moe_kernels(batch_invariant=False).provided()) == ["experts", "router_logits", "select_experts"]
    assert plugin.k3_mla_kernels(batch_invariant=False).decode.__name__ == "mla_decode_native"
    assert plugin.k3_attn_res_kernels(batch_invariant=False).provided() == ["step"]
    assert sorted(plugin.k3_mla_kernels(batch_invariant=False).provided()) == ["decode", "prefill"]
    assert sorted(plugin.k3_indexer_kernels(batch_invariant=False).provided()) == ["paged_decode_scores", "scores", "topk"]
    assert sorted(plugin.k3_elementwise_kernels(batch_invariant=False).provided()) == ["glu_activation", "rms_norm"]
    monkeypatch.setenv("K3_NVIDIA_DISABLE", "moe_experts")      # moe.experts has two: moe_experts_bf16 still serves
    assert plugin.k3_moe_kernels(batch_invariant=False).experts.__name__ == "experts_forward_bf16_decode"
    monkeypatch.setenv("K3_NVIDIA_DISABLE", "moe_experts, moe_experts_bf16, moe_router_logits, mla_prefill, rms_norm")
    assert plugin.k3_moe_kernels(batch_invariant=False).provided() == ["select_experts"]
    assert plugin.k3_elementwise_kernels(batch_invariant=False).provided() == ["glu_activation"]
    assert plugin.k3_mla_kernels(batch_invariant=False).provided() == ["decode"]
    monkeypatch.setenv("K3_NVIDIA_DISABLE", "all")
    assert plugin.k3_moe_kernels(batch_invariant=False) is None and plugin.k3_attn_res_kernels(batch_invariant=False) is None
    assert plugin.k3_mla_kernels(batch_invariant=False) is None and plugin.k3_kda_kernels(batch_invariant=False) is None
    monkeypatch.setenv("K3_NVIDIA_DISABLE", "moe_router,typo")
    with pytest.warns(UserWarning, match="typo"):
        assert sorted(plugin.k3_moe_kernels(batch_invariant=False).provided()) == ["experts", "router_logits"]


def test_nvidia_experimental_kernels_enter_only_when_named(monkeypatch):
    pytest.importorskip("triton")
    from k3.platforms.nvidia import experimental, plugin

    monkeypatch.delenv("K3_NVIDIA_DISABLE", raising=False)
    monkeypatch.delenv("K3_NVIDIA_EXPERIMENTAL", raising=False)
    monkeypatch.setattr(experimental, "has_module", lambda name: True)       # fla-core installed
    kda = ["chunked", "decode_step", "recurrent", "short_conv"]
    assert sorted(plugin.k3_kda_kernels(batch_invariant=False).provided()) == kda
    assert plugin.k3_kda_kernels(batch_invariant=False).chunked.__module__.endswith("triton_kernels.kda_chunked_blocked")
    monkeypatch.setenv("K3_NVIDIA_DISABLE", "kda_chunked_blocked")        # the torch one without the Triton diagonal
    assert plugin.k3_kda_kernels(batch_invariant=False).chunked.__module__.endswith("torch_kernels.kda_chunked_blocked")
    monkeypatch.delenv("K3_NVIDIA_DISABLE")
    monkeypatch.setenv("K3_NVIDIA_EXPERIMENTAL", "kda_chunked")           # fla-core's, in place of the promoted one
    assert sorted(plugin.k3_kda_kernels(batch_invariant=False).provided()) == kda
    assert plugin.k3_kda_kernels(batch_invariant=False).chunked.__module__.endswith("triton_kernels.kda_chunked")
    monkeypatch.setenv("K3_NVIDIA_EXPERIMENTAL", "all")
    assert sorted(plugin.k3_kda_kernels(batch_invariant=False).provided()) == ["chunked", "decode_step", "recurrent",
                                                                          "short_conv"]
    monkeypatch.setenv("K3_NVIDIA_EXPERIMENTAL", "kda_chunked,typo")
    with pytest.warns(UserWarning, match="typo"):
        assert "chunked" in plugin.k3_kda_kernels(batch_invariant=False).provided()


def test_nvidia_repacks_experts_tile_major_only_where_the_bf16_decode_entry_serves(monkeypatch):
    """Where `moe_experts_bf16` serves moe.experts (promoted: by default), k3_process_weights repacks
    every MoE layer's experts tile-major in place (MoE.hold_experts_tile_major); with it disabled,
    or with an experimental moe.experts kernel named in its place (the grouped gemv, which reads only
    the checkpoint layout), it leaves them."""
    pytest.importorskip("triton")
    from k3.platforms.nvidia import experimental, plugin

    repacked = []
    moe = torch.nn.Module()
    moe.hold_experts_tile_major = lambda: repacked.append(True) or True
    model = torch.nn.Sequential(moe, torch.nn.Linear(2, 2))
    monkeypatch.delenv("K3_NVIDIA_EXPERIMENTAL", raising=False)
    monkeypatch.delenv("K3_NVIDIA_DISABLE", raising=False)
    assert experimental.serving("moe.experts") == "moe_experts_bf16"
    plugin.k3_process_weights(model)
    assert repacked == [True]
    monkeypatch.setenv("K3_NVIDIA_DISABLE", "moe_experts_bf16")
    assert experimental.serving("moe.experts") == "moe_experts"
    assert plugin.k3_moe_kernels(batch_invariant=False).experts.__name__ == "experts_forward"
    plugin.k3_process_weights(model)
    monkeypatch.delenv("K3_NVIDIA_DISABLE")
    monkeypatch.setenv("K3_NVIDIA_EXPERIMENTAL", "moe_experts_grouped")
    assert experimental.serving("moe.experts") == "moe_experts_grouped"
    assert plugin.k3_moe_kernels(batch_invariant=False).experts.__name__ == "experts_forward_grouped"
    plugin.k3_process_weights(model)
    assert repacked == [True]
    monkeypatch.setenv("K3_NVIDIA_DISABLE", "all")
    monkeypatch.delenv("K3_NVIDIA_EXPERIMENTAL")
    assert experimental.serving("moe.experts") is None


def test_nvidia_captures_decode_with_cuda_graphs():
    from k3.platforms.nvidia import plugin
    from k3.platforms.nvidia.graphs import CudaGraphCapturer

    assert isinstance(plugin.k3_graph_runner(), CudaGraphCapturer)


def test_every_experimental_nvidia_kernel_is_documented():
    from pathlib import Path

    from k3.platforms.nvidia import experimental

    readme = (Path(experimental.__file__).parent / "README.md").read_text()
    missing = [name for name in experimental.ALL if f"`{name}`" not in readme]
    assert not missing, f"platforms/nvidia/README.md does not describe {missing}"
