"""Compile every Triton kernel the amd plugin serves for gfx942 (MI300X) and gfx950 (MI355X) on
any machine, no ROCm or GPU needed, and print the AMDGPU resource report per kernel and
launch variant: VGPRs, AGPRs, SGPRs, their spills, scratch, LDS, occupancy (waves per SIMD).

    python3 bench/amdgcn_report.py [--json] [--arch gfx950] [--subset] [--jobs N]

Triton's AMD backend (`triton.compile` with `GPUTarget("hip", arch, 64)`) runs every stage here
from what pip installs: TTIR -> TTGIR -> LLIR -> AMDGCN (LLVM's AMDGPU target in libtriton) ->
hsaco (assembled and linked by the lld that libtriton links in, `amd.link_hsaco`; no ROCm
ld.lld). Each row records the last stage that ran ("hsaco" when the code object was linked)
and, where one failed, its error. The numbers are the AMDGCN assembly's kernel metadata
(.vgpr_count, .sgpr_count, .agpr_count, .vgpr_spill_count, .sgpr_spill_count,
.private_segment_fixed_size, "; Occupancy") and the LDS Triton allocates (metadata.shared). Nothing
here ran on AMD hardware.

The variants are bench/ptxas_report.py's (K3's shapes) for the kernels the amd plugin serves
(k3.platforms.amd.kernels), rewritten for the target as its launch table (k3.platforms.amd.archs)
serves them: fp8 operands in the target's flavour (fp8e4b8 / FNUZ on gfx942, fp8e4nv / OCP on
gfx950), IEEE fp32 dots where the target has no tf32 (gfx950) and for NVIDIA's 3xTF32, no
inline-PTX (gemv) MoE tiles, the chunked KDA recurrence in its fp32-FMA form. --subset keeps
the variants the plugin launches only (`launched`); --kernels limits a run to some kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STAGES = ("ttir", "ttgir", "llir", "amdgcn", "hsaco")
# the kernels of ptxas_report.variants() that the amd plugin launches (gemv-only helpers and the
# 3xTF32 tensor-core recurrence are NVIDIA's)
SERVED = {"kda_decode", "kda_recurrent", "kda_chunked_recurrence", "kda_intra_chunk", "short_conv", "moe_gate_up",
          "moe_down", "moe_dequant", "router", "attn_res", "mla_decode", "mla_merge", "indexer_decode",
          "indexer_decode_mxfp4", "indexer_prefill", "rms_norm", "glu"}
METADATA = {"vgprs": "vgpr_count", "sgprs": "sgpr_count", "agprs": "agpr_count", "vgpr_spills": "vgpr_spill_count",
            "sgpr_spills": "sgpr_spill_count", "scratch_bytes": "private_segment_fixed_size"}


# the variants the amd plugin launches at K3's shapes (archs.py's launch table; the others are
# ptxas_report's sweep, compiled for comparison): kernel -> variant names, per target where they differ
LAUNCHED = {
    "kda_decode": {"w4_statefirst1_bv16"}, "kda_chunked_recurrence": {"C64_K128_bv16_w8"},
    "kda_intra_chunk": {"C64_K128_w4_s16_d16"},
    # 16 positions a step (archs.py): gfx942's fp8 pages are FNUZ, which the reference op serves
    "mla_decode": {"gfx950": {"kvbf16_native_n16", "kvfp8e4nv_native_n16"}, "gfx942": {"kvbf16_native_n16"}},
    "moe_gate_up": {"gfx950": {"dot_scaled_n64_k128_t16", "dot_scaled_n128_k64_t16", "dot_scaled_n128_k64_t64",
                               "decode_n64_k128_t16", "decode_n128_k64_t16"},
                    "gfx942": {"decode_n64_k128_t16", "decode_n128_k64_t16"}},
}
LAUNCHED["moe_down"] = LAUNCHED["moe_gate_up"]
# the MoE decode-mode tiles (gfx942's bf16 batches, fp32 / fp16 on both), as
# moe_mxfp4.launch_options gives them (one token; more)
DECODE_TILES = ((64, 16, 128, 4), (128, 16, 64, 8))


def launched(arch_name: str, kernel: str, variant: str) -> bool:
    """Whether the amd plugin launches this variant on arch_name (every variant of a kernel
    LAUNCHED does not name)."""
    names = LAUNCHED.get(kernel)
    if isinstance(names, dict):
        names = names[arch_name]
    return names is None or variant in names


def for_target(arch_name: str, name: str, variant: str, fn, types: dict, constexprs: dict, warps: int) -> list:
    """ptxas_report's variant rewritten as the amd plugin serves it on `arch_name` (a list of
    variants: none when the amd plugin does not launch the kernel)."""
    from k3.platforms.amd import archs

    target = archs.arch(arch_name)
    if name not in SERVED or constexprs.get("ASM") or "mma_" in variant:
        return []
    if name in ("moe_gate_up", "moe_down") and constexprs.get("MODE") == 0 and not target.native_mxfp4:
        return []                                   # dot_scaled: gfx950's mode (archs.py); gfx942 decodes
    types = {k: (f"*{target.fp8_triton}" if v == "*fp8e4nv" else v) for k, v in types.items()}
    variant = variant.replace("fp8e4nv", target.fp8_triton)
    cx = dict(constexprs)
    if cx.get("PRECISION") == "tf32x3" or (cx.get("PRECISION") == "tf32" and not target.tf32):
        if name in ("kda_chunked_recurrence", "kda_intra_chunk"):
            return []                               # the fp32 ("ieee") variants are compiled anyway
        cx["PRECISION"] = "ieee"
    if "IEEE" in cx and not target.tf32:
        cx["IEEE"] = True
    if name in ("moe_gate_up", "moe_down") and cx.get("MODE") == 1:      # fp32 / fp16 batches (gfx942: all)
        return [(name, f"decode_n{n}_k{k}_t{t}", fn, types, dict(cx, BLOCK_N=n, BLOCK_T=t, BLOCK_K=k), w)
                for n, t, k, w in DECODE_TILES]
    if name == "mla_decode" and cx.get("NATIVE"):                       # the AMD launch table's BLOCK_N too
        return [(name, variant, fn, types, cx, warps), (name, f"{variant}_n16", fn, types, dict(cx, BLOCK_N=16), warps)]
    return [(name, variant, fn, types, cx, warps)]


def variants(arch_name: str, subset: bool = False) -> list[tuple]:
    """(kernel, variant, fn, types, constexprs, num_warps) of every served kernel on arch_name;
    subset: only the variants the plugin launches (`launched`)."""
    import ptxas_report

    out = []
    for row in ptxas_report.variants():
        for rewritten in for_target(arch_name, *row):
            if any(r[:2] == rewritten[:2] for r in out) or (subset and not launched(arch_name, *rewritten[:2])):
                continue
            out.append(rewritten)
    return out


def _number(text: str, key: str) -> int | None:
    m = re.search(rf"\.{key}:\s+(\d+)", text)
    return int(m.group(1)) if m else None


def compile_report(arch_name: str, fn, types: dict[str, str], constexprs: dict, num_warps: int) -> dict:
    """Compile fn for `arch_name` through every stage Triton's AMD backend has: {"stage" (the
    last that ran), "error" (None, or the failing stage's exception), and the resource numbers
    when the AMDGCN stage ran}."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if types.get(name, "")[:1] == "*" or (types.get(name) == "i32" and name.startswith("s_"))}
    source = ASTSource(fn, signature=signature, attrs=aligned,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    ran: list[str] = []

    def inspect(backend, stages, options, language, capability):     # records each stage as it finishes
        for key in list(stages):
            stage = stages[key]
            stages[key] = lambda src, metadata, _stage=stage, _key=key: (_stage(src, metadata), ran.append(_key))[0]

    row = {"stage": None, "error": None}
    previous = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = inspect
    try:
        kernel = triton.compile(source, target=GPUTarget("hip", arch_name, 64), options={"num_warps": num_warps})
    except Exception as e:                      # a stage that cannot run here: record which and why
        row.update(stage=ran[-1] if ran else None, error=f"{type(e).__name__}: {str(e).strip()[-500:]}")
        return row
    finally:
        knobs.runtime.add_stages_inspection_hook = previous
    asm = kernel.asm["amdgcn"]
    row["stage"] = ran[-1] if ran else "hsaco"
    row.update({k: _number(asm, key) for k, key in METADATA.items()})
    occupancy = re.search(r";\s*Occupancy:\s*(\d+)", asm)
    row["occupancy_waves"] = int(occupancy.group(1)) if occupancy else None
    row["lds_bytes"] = kernel.metadata.shared
    row["hsaco_bytes"] = len(kernel.asm["hsaco"]) if "hsaco" in kernel.asm else 0
    return row


def _selected(arch_name: str, subset: bool, kernels: set[str] | None) -> list[tuple]:
    """The variants of `variants` that `kernels` names (a kernel, or "kernel/variant"; None: all)."""
    return [v for v in variants(arch_name, subset) if kernels is None or v[0] in kernels or f"{v[0]}/{v[1]}" in kernels]


def _one(job: tuple) -> dict:
    arch_name, subset, kernels, index = job
    name, variant, fn, types, constexprs, warps = _selected(arch_name, subset, kernels)[index]
    return {"arch": arch_name, "kernel": name, "variant": variant, "num_warps": warps,
            "launched": launched(arch_name, name, variant), **compile_report(arch_name, fn, types, constexprs, warps)}


def report(selection: list[tuple[str, bool, set[str] | None]], jobs: int = 1) -> list[dict]:
    """Rows for every (arch, subset, kernels or None for all) of `selection`, compiled over
    `jobs` processes."""
    work = [(a, s, k, i) for a, s, k in selection for i in range(len(_selected(a, s, k)))]
    if jobs <= 1:
        return [_one(w) for w in work]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_one, work))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--arch", action="append", choices=("gfx942", "gfx950"),
                        help="target (repeatable; default both)")
    parser.add_argument("--subset", action="store_true", help="only the variants the amd plugin launches")
    parser.add_argument("--kernels", metavar="ARCH=K1,K2", action="append", default=[],
                        help="compile only these kernels (or kernel/variant) for ARCH (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    args = parser.parse_args()
    only = {spec.split("=")[0]: set(spec.split("=")[1].split(",")) for spec in args.kernels}
    rows = report([(a, args.subset, only.get(a)) for a in (args.arch or ["gfx942", "gfx950"])], args.jobs)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'arch':<7} {'kernel':<22} {'variant':<34} {'w':>2} {'L':>1} {'stage':<6} {'vgpr':>4} {'agpr':>4} {'sgpr':>4} "
          f"{'spill':>5} {'scratch':>7} {'LDS B':>6} {'occ':>3}")
    for r in rows:
        if r["error"]:
            print(f"{r['arch']:<7} {r['kernel']:<22} {r['variant']:<34} {r['num_warps']:>2} after {r['stage']}: "
                  f"{r['error'][:80]}")
            continue
        mark = "*" if r["launched"] else ""
        print(f"{r['arch']:<7} {r['kernel']:<22} {r['variant']:<34} {r['num_warps']:>2} {mark:>1} {r['stage']:<6} "
              f"{r['vgprs']:>4} {r['agprs']:>4} {r['sgprs']:>4} {r['vgpr_spills'] + r['sgpr_spills']:>5} "
              f"{r['scratch_bytes']:>7} {r['lds_bytes']:>6} {r['occupancy_waves'] or '':>3}")


if __name__ == "__main__":
    main()
