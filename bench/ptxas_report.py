"""Compile k3's Triton kernels for the H200 (sm_90a) on any machine, no GPU needed, and print
ptxas's resource report: registers per thread and spill bytes, per kernel and launch variant.

    python3 bench/ptxas_report.py [--json]

Triton lowers each specialisation to PTX here and the ptxas that ships in Triton's wheel
assembles it, so compile errors that the Triton interpreter cannot show (layouts, dot shapes,
types) and register spills (local-memory traffic, the first suspect when a memory-bound kernel
misses its bandwidth) are found before a device call. Shapes are K3's: 96 KDA heads of 128,
MLA latent 512 + 64, k3-slice experts (latent 3584, width 3072), hidden 7168.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
# MXFP4 MoE tiles compiled: (mode 0 dot_scaled / 1 decode, rows, tokens, columns, warps); the first
# two are what moe_mxfp4.launch_options serves at batch 1 and above, the fourth its prefill tile
MOE_TILES = ((0, 64, 16, 128, 4), (0, 128, 16, 64, 8), (0, 128, 64, 64, 8), (0, 128, 64, 64, 4), (1, 64, 16, 64, 4))
# the gemv mode's (rows, columns, warps, pipeline stages, rows per thread, prefetch, fp16x2 chain or 0 for fp32
# products): the former one-row tile, the two fp32-product tiles served before the fp16x2 form, and that form
MOE_GEMV_TILES = ((16, 512, 4, 1, 1, False, 0), (32, 512, 4, 1, 4, False, 0), (32, 256, 2, 1, 4, True, 0),
                  (16, 512, 4, 1, 2, True, 0), (32, 512, 4, 1, 4, False, 4), (32, 512, 4, 1, 4, False, 1),
                  (32, 256, 2, 1, 4, True, 4), (32, 256, 2, 1, 4, True, 1))
# variants launched with a register cap (Triton's maxnreg): (kernel, variant) -> registers
MAX_REGISTERS = {("kda_chunked_recurrence", "split_state_C64_K128_bv32_w4_s1_r168_tf32x3"): 168}


def ptxas_path() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def assemble(fn, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int | None = None,
             disassemble: bool = False, maxnreg: int | None = None):
    """Compile fn (a @triton.jit function) for sm_90a and assemble it with ptxas: (the Triton
    kernel, ptxas's -v report, the SASS when `disassemble`, by the wheel's cuobjdump, else "").

    types: Triton type of every runtime argument ("*bf16", "*fp32", "i32", "fp32"...);
    constexprs: the compile-time arguments; num_stages: Triton's software-pipeline depth (None:
    its default); maxnreg: a register cap (Triton's launch option; None: ptxas's choice).
    """
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    # pointers 16-byte aligned and strides (s_*) multiples of 16, as Triton specialises them at
    # launch for K3's dimensions (without it, it emits byte loads and keeps more registers)
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if types.get(name, "")[:1] == "*" or (types.get(name) == "i32" and name.startswith("s_"))}
    source = ASTSource(fn, signature=signature, attrs=aligned,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    options = {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {}),
               **({"maxnreg": maxnreg} if maxnreg else {})}
    kernel = triton.compile(source, target=TARGET, options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        done = subprocess.run([ptxas_path(), "-v", "--gpu-name=sm_90a", ptx, "-o", cubin],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"ptxas failed for {fn.__name__}: {done.stderr[-2000:]}")
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas_path()), "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout if disassemble else ""
    return kernel, done.stderr, sass


def compile_report(fn, types: dict[str, str], constexprs: dict, num_warps: int, maxnreg: int | None = None) -> dict:
    """Compile fn (a @triton.jit function) for sm_90a (`assemble`): {"registers",
    "spill_bytes", "shared_bytes", "convert_layouts", "barriers"}."""
    kernel, text, _ = assemble(fn, types, constexprs, num_warps, maxnreg=maxnreg)
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, text)) else 0  # noqa: E731
    # layout conversions (TTGIR) and barriers (PTX): each is a shared-memory round trip; in a loop
    # body they are paid every step (the grouped gemv's census: BENCHMARKS.md, 2026-12-04)
    return {"registers": number(r"Used (\d+) registers"), "spill_bytes": number(r"(\d+) bytes spill stores"),
            "shared_bytes": kernel.metadata.shared, "convert_layouts": kernel.asm["ttgir"].count("ttg.convert_layout"),
            "barriers": kernel.asm["ptx"].count("bar.sync")}


def _types(fn, pointers: dict[str, str], floats: tuple[str, ...], default_pointer="*bf16") -> dict[str, str]:
    out = {}
    for name in fn.arg_names:
        if name.endswith("_ptr"):
            out[name] = pointers.get(name, default_pointer)
        else:
            out[name] = "fp32" if name in floats else "i32"
    return out


def variants():
    """(kernel name, variant, fn, types, constexprs, num_warps) of every kernel k3 launches."""
    from k3.platforms.triton_kernels import (attn_res, indexer_decode, indexer_decode_mxfp4, indexer_prefill,
                                             kda_decode, kda_recurrent, glu, mla_decode, moe_mxfp4, moe_mxfp4_dequant,
                                             moe_mxfp4_gemv, moe_mxfp4_gemv_grouped, rms_norm, router, short_conv)

    fn = kda_decode._kda_decode_step_kernel
    types = _types(fn, {"rec_ptr": "*fp32", "dt_bias_ptr": "*fp32", "a_log_ptr": "*fp32", "idx_ptr": "*i64",
                        "fresh_ptr": "*u8"}, ("scale", "lower_bound", "norm_eps", "l2_eps"))
    base = dict(H=96, K=128, W=4, SOFTPLUS_GATE=False)
    for warps, first, block_v in ((4, True, 128), (4, False, 128), (4, True, 32), (4, True, 16), (8, True, 32)):
        yield ("kda_decode", f"w{warps}_statefirst{int(first)}_bv{block_v}", fn, types,
               {**base, "STATE_FIRST": first, "BLOCK_V": block_v}, warps)

    fn = kda_recurrent._kda_recurrent_kernel
    types = _types(fn, {"g_ptr": "*fp32", "beta_ptr": "*fp32", "h0_ptr": "*fp32", "cu_ptr": "*i32", "ht_ptr": "*fp32",
                        "states_ptr": "*fp32", "u_ptr": "*fp32"}, ("scale",))
    yield ("kda_recurrent", "verify_states_u_bv32", fn, types,
           dict(K=128, V=128, BLOCK_V=32, VARLEN=True, HAS_H0=True, STORE_STATES=True, STORE_U=True), 4)

    from k3.platforms.triton_kernels import kda_chunked_recurrence

    fn = kda_chunked_recurrence._recurrence_kernel                 # the chunked prefill's phase 2, fp32 FMA dots
    types = _types(fn, {"seg_ptr": "*i32", "slot_ptr": "*i32"}, (), default_pointer="*fp32")
    for block_v, precision in ((32, "ieee"), (16, "ieee"), (32, "tf32x3")):
        yield ("kda_chunked_recurrence", f"C64_K128_bv{block_v}_w8" + ("" if precision == "ieee" else f"_{precision}"),
               fn, types, dict(C=64, K=128, V=128, BLOCK_C=64, BLOCK_K=128, BLOCK_V=block_v,
                               SLICE=kda_chunked_recurrence.SLICE, PRECISION=precision),
               kda_chunked_recurrence.NUM_WARPS)

    fn = kda_chunked_recurrence._recurrence_mma_kernel             # its tensor-core form (3xTF32), state in registers
    for block_v, warps in ((32, 4), (16, 4), (64, 8)):
        yield ("kda_chunked_recurrence", f"mma_C64_K128_bv{block_v}_w{warps}_tf32x3", fn, types,
               dict(C=64, K=128, V=128, BLOCK_C=64, BLOCK_K=128, BLOCK_V=block_v, PRECISION="tf32x3"), warps)

    fn = kda_chunked_recurrence._recurrence_mma_rows_kernel        # the served form: o stored to the bf16 token rows
    rows_types = _types(fn, {"seg_ptr": "*i32", "slot_ptr": "*i32", "idx_ptr": "*i64", "o_ptr": "*bf16"}, (),
                        default_pointer="*fp32")
    yield ("kda_chunked_recurrence", "mma_rows_C64_K128_bv32_w4_tf32x3", fn, rows_types,
           dict(C=64, K=128, V=128, BLOCK_C=64, BLOCK_K=128, BLOCK_V=32, PRECISION="tf32x3"), 4)

    from k3.platforms.triton_kernels import kda_chunked_state

    # phase 2 split (kda_chunked_state.recurrence_split): the state kernel (two 3xTF32 dots a chunk,
    # the next chunk's tiles prefetched at s2; r168: held to 168 registers, MAX_REGISTERS) ...
    fn = kda_chunked_state._state_kernel
    types = _types(fn, {"seg_ptr": "*i32", "slot_ptr": "*i32", "cnt_ptr": "*i32"}, (), default_pointer="*fp32")
    for block_v, stages in ((64, 2), (32, 2), (32, 1)):
        yield ("kda_chunked_recurrence", f"split_state_C64_K128_bv{block_v}_w4_s{stages}"
               + ("_r168" if stages == 1 else "") + "_tf32x3", fn, types,
               dict(C=64, K=128, V=128, BLOCK_C=64, BLOCK_K=128, BLOCK_V=block_v, PRECISION="tf32x3",
                    NUM_STAGES=stages, STEPS=0), 4)
    # ... and the output product, o stored to the bf16 token rows
    fn = kda_chunked_state._output_rows_kernel
    types = _types(fn, {"idx_ptr": "*i64", "o_ptr": "*bf16"}, (), default_pointer="*fp32")
    for block_v in (64, 32):
        yield ("kda_chunked_recurrence", f"split_out_rows_C64_K128_bv{block_v}_w4_k64_tf32x3", fn, types,
               dict(C=64, K=128, V=128, BLOCK_C=64, BLOCK_K=128, BLOCK_V=block_v, K_SLICE=64, PRECISION="tf32x3"), 4)

    from k3.platforms.triton_kernels import kda_intra_chunk

    fn = kda_intra_chunk._intra_chunk_kernel                      # the chunked prefill's phase 1
    types = _types(fn, {"index_ptr": "*i64"}, (), default_pointer="*fp32")
    for warps, slice_, diag_slice, precision in ((4, 16, 16, "ieee"), (4, 16, 32, "ieee"), (8, 32, 16, "ieee"),
                                                 (4, 16, 16, "tf32x3")):
        yield ("kda_intra_chunk", f"C64_K128_w{warps}_s{slice_}_d{diag_slice}" + ("" if precision == "ieee" else
                                                                                 f"_{precision}"),
               fn, types, dict(C=64, K=128, V=128, BLOCK_K=128, BLOCK_V=128, BLOCK=kda_intra_chunk.BLOCK, SLICE=slice_,
                               DIAG_SLICE=diag_slice, PRECISION=precision, NEUMANN=True), warps)
    # the diagonal blocks a column at a time (DIAG_COLUMNS, served since 2026-12-07: no [16, 16, slice] decays)
    yield ("kda_intra_chunk", "C64_K128_w4_s16_d16_columns", fn, types,
           dict(C=64, K=128, V=128, BLOCK_K=128, BLOCK_V=128, BLOCK=kda_intra_chunk.BLOCK, SLICE=16, DIAG_SLICE=16,
                PRECISION="ieee", NEUMANN=True, DIAG_COLUMNS=True), 4)
    fn = kda_intra_chunk._intra_chunk_mma_kernel                  # phase 1's whole-chunk tensor-core form
    for warps, slice_ in ((4, 64), (4, 32)):
        yield ("kda_intra_chunk", f"mma_C64_K128_w{warps}_s{slice_}_tf32x3", fn, types,
               dict(C=64, K=128, V=128, BLOCK_C=64, BLOCK_K=128, BLOCK_V=128, BLOCK=kda_intra_chunk.BLOCK, SLICE=slice_,
                    DIAG_SLICE=kda_intra_chunk.DIAG_SLICE, PRECISION="tf32x3", NEUMANN=True), warps)

    from k3.platforms.triton_kernels import kda_intra_split

    # phase 1's split form (three launches): A's block rows with the decays, T's substitution, W and U
    fn = kda_intra_split._split_blocks_kernel
    types = _types(fn, {"index_ptr": "*i64"}, (), default_pointer="*fp32")
    for warps, slice_, precision in ((4, 16, "tf32x3"), (4, 32, "tf32x3"), (8, 16, "tf32x3"), (4, 16, "ieee")):
        yield ("kda_intra_chunk", f"split_blocks_C64_K128_w{warps}_s{slice_}_{precision}", fn, types,
               dict(C=64, K=128, BLOCK_C=64, BLOCK_K=128, BLOCK=kda_intra_split.BLOCK, SLICE=slice_,
                    PRECISION=precision, SOLVE_PRECISION=kda_intra_split.SOLVE_PRECISION, NEUMANN=True), warps)
    yield ("kda_intra_chunk", "split_blocks_C64_K128_w4_s16_tf32x3_columns", fn, types,
           dict(C=64, K=128, BLOCK_C=64, BLOCK_K=128, BLOCK=kda_intra_split.BLOCK, SLICE=16, PRECISION="tf32x3",
                SOLVE_PRECISION=kda_intra_split.SOLVE_PRECISION, NEUMANN=True, DIAG_COLUMNS=True), 4)
    fn = kda_intra_split._split_solve_kernel
    for warps in (4, 8):
        yield ("kda_intra_chunk", f"split_solve_C64_w{warps}_{kda_intra_split.SOLVE_PRECISION}", fn,
               _types(fn, {}, (), default_pointer="*fp32"),
               dict(C=64, BLOCK_C=64, BLOCK=kda_intra_split.BLOCK, SOLVE_PRECISION=kda_intra_split.SOLVE_PRECISION),
               warps)
    fn = kda_intra_split._split_wu_kernel
    types = _types(fn, {"index_ptr": "*i64"}, (), default_pointer="*fp32")
    for warps, cols, precision, is_w in ((4, 64, "tf32x3", True), (4, 64, "tf32x3", False), (8, 64, "tf32x3", True),
                                         (4, 32, "tf32x3", True), (4, 64, "ieee", True), (4, 32, "ieee", True)):
        yield ("kda_intra_chunk", f"split_{'w' if is_w else 'u'}_C64_K128_w{warps}_c{cols}_{precision}", fn, types,
               dict(C=64, K=128, V=128, BLOCK_C=64, BLOCK=kda_intra_split.BLOCK, W_SLICE=cols, IS_W=is_w,
                    PRECISION=precision), warps)

    fn = short_conv._short_conv_kernel
    types = _types(fn, {"w_ptr": "*bf16", "seq_ptr": "*i32", "pos_ptr": "*i32"}, ())
    yield ("short_conv", "W4_bf16", fn, types, dict(W=4, SILU=True, BLOCK_T=16, BLOCK_C=64), 4)

    fn = moe_mxfp4._gate_up_kernel
    types = _types(fn, {"p13_ptr": "*u8", "s13_ptr": "*u8", "tile_expert_ptr": "*i32", "tile_start_ptr": "*i32",
                        "order_ptr": "*i32",
                        "start_ptr": "*i32", "count_ptr": "*i32", "act_ptr": "*bf16", "delta_ptr": "*fp32"},
                   ("beta", "linear_beta"))
    base = dict(L=3584, I=3072, SITU=True, HAS_LINEAR_BETA=False, IEEE=False, ROUND_ACT=1, ROUND_PRODUCTS=1,
                HAS_DELTA=False)
    for mode, block_n, block_t, block_k, warps in MOE_TILES:
        variant = f"{'dot_scaled' if mode == 0 else 'decode'}_n{block_n}_k{block_k}_t{block_t}"
        act = {"act_ptr": "*bf16" if mode == 0 else "*fp32"}
        yield ("moe_gate_up", variant, fn, {**types, **act},
               dict(base, MODE=mode, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, PIPELINED=True, SCALES_AHEAD=True, TILED=False), warps)
    fn = moe_mxfp4._down_kernel
    types = _types(fn, {"p2_ptr": "*u8", "s2_ptr": "*u8", "tile_expert_ptr": "*i32", "tile_start_ptr": "*i32",
                        "order_ptr": "*i32",
                        "start_ptr": "*i32", "count_ptr": "*i32", "weight_ptr": "*fp32", "y_ptr": "*fp32",
                        "delta_ptr": "*fp32"}, ())
    for mode, block_n, block_t, block_k, warps in MOE_TILES:
        variant = f"{'dot_scaled' if mode == 0 else 'decode'}_n{block_n}_k{block_k}_t{block_t}"
        act = {"act_ptr": "*bf16" if mode == 0 else "*fp32"}
        yield ("moe_down", variant, fn, {**types, **act},
               dict(L=3584, I=3072, MODE=mode, IEEE=False, ROUND_ACT=1, ROUND_PRODUCTS=1, HAS_DELTA=False,
                    BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, PIPELINED=True, SCALES_AHEAD=True, TILED=False), warps)

    for block_n, block_k, warps, stages, split, prefetch, chain in MOE_GEMV_TILES:
        name = (f"gemv_n{block_n}_k{block_k}_w{warps}_s{stages}_u{split}" + ("_prefetch" if prefetch else "")
                + (f"_fp16x2_c{chain}" if chain else ""))
        form = dict(BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, SPLIT=split, PREFETCH=prefetch, HALF=bool(chain),
                    CHAIN=chain or 4, ASM=True, ROUND_PRODUCTS=0 if chain else 1, TILED=False)  # fp16x2: legacy
        planes = "*i32" if chain else "*bf16"                       # fp16 pairs as int32 words, or bf16 planes
        fn = moe_mxfp4_gemv.gate_up_kernel
        types = _types(fn, {"p13_ptr": "*u8", "s13_ptr": "*u8", "ids_ptr": "*i64", "act_ptr": "*fp16" if chain else
                            "*bf16", "x_ptr": planes, "x_unscale_ptr": "*fp32", "act_unscale_ptr": "*fp32"},
                       ("beta", "linear_beta"))
        yield ("moe_gate_up", name, fn, types,
               dict(L=3584, I=3072, SITU=True, HAS_LINEAR_BETA=False, ROUND_ACT=1, **form), warps)
        fn = moe_mxfp4_gemv.down_kernel
        types = _types(fn, {"p2_ptr": "*u8", "s2_ptr": "*u8", "ids_ptr": "*i64", "weight_ptr": "*fp32",
                            "y_ptr": "*fp32", "act_ptr": planes, "act_unscale_ptr": "*fp32"}, ())
        yield ("moe_down", name, fn, types, dict(L=3584, I=3072, **form), warps)

    # the gemv's served fp16x2 tile with each weight tile decoded once for `tokens` pairs of its expert
    form = dict(BLOCK_N=32, BLOCK_K=512, STAGES=1, SPLIT=4, CHAIN=4, ASM=True)
    grouping = {"tile_expert_ptr": "*i32", "tile_start_ptr": "*i32", "order_ptr": "*i32", "start_ptr": "*i32",
                "count_ptr": "*i32"}
    for tokens in moe_mxfp4_gemv_grouped.TOKENS_SERVED[1:]:
        name = f"gemv_grouped_t{tokens}_n32_k512_w4_u4_fp16x2_c4"
        fn = moe_mxfp4_gemv_grouped.gate_up_kernel
        types = _types(fn, {"p13_ptr": "*u8", "s13_ptr": "*u8", "act_ptr": "*fp16", "x_ptr": "*i32",
                            "x_unscale_ptr": "*fp32", "act_unscale_ptr": "*fp32", **grouping}, ("beta", "linear_beta"))
        yield ("moe_gate_up", name, fn, types,
               dict(L=3584, I=3072, SITU=True, HAS_LINEAR_BETA=False, ROUND_ACT=1, TOKENS=tokens, **form), 4)
        fn = moe_mxfp4_gemv_grouped.down_kernel
        types = _types(fn, {"p2_ptr": "*u8", "s2_ptr": "*u8", "weight_ptr": "*fp32", "y_ptr": "*fp32",
                            "act_ptr": "*i32", "act_unscale_ptr": "*fp32", **grouping}, ())
        yield ("moe_down", name, fn, types, dict(L=3584, I=3072, TOKENS=tokens, **form), 4)

    fn = moe_mxfp4_gemv._half_planes_kernel
    yield ("moe_half_planes", "L3584_g16", fn, _types(fn, {"out_ptr": "*fp16", "unscale_ptr": "*fp32"}, ()),
           dict(L=3584, GROUPS=16), 4)

    fn = moe_mxfp4_dequant._dequantize_kernel
    types = _types(fn, {"packed_ptr": "*u8", "scales_ptr": "*u8", "ids_ptr": "*i32", "out_ptr": "*bf16"}, ())
    yield ("moe_dequant", "bf16_L3584", fn, types, dict(HALF_COLS=1792, BLOCK_ROWS=moe_mxfp4_dequant.BLOCK_ROWS,
                                                         BLOCK_BYTES=moe_mxfp4_dequant.BLOCK_BYTES), 4)

    fn = indexer_decode._paged_scores_kernel
    types = _types(fn, {"q_ptr": "*fp32", "w_ptr": "*fp32", "values_ptr": "*fp8e4nv", "scales_ptr": "*fp32",
                        "table_ptr": "*i32", "lens_ptr": "*i64", "out_ptr": "*fp32"}, ())
    yield ("indexer_decode", "k3.1_Hi32_D128_page64", fn, types, dict(HI=32, D=128, PAGE=64, BLOCK_L=64, IEEE=False), 4)

    fn = indexer_decode_mxfp4._mxfp4_scores_kernel
    types = _types(fn, {"qe_ptr": "*fp32", "qo_ptr": "*fp32", "w_ptr": "*fp32", "values_ptr": "*u8",
                        "scales_ptr": "*u8", "table_ptr": "*i32", "lens_ptr": "*i64", "out_ptr": "*fp32"}, ())
    yield ("indexer_decode_mxfp4", "k3.1_Hi32_D128_page64", fn, types,
           dict(HI=32, HALF_D=64, PAGE=64, BLOCK_L=64, IEEE=False), 4)

    fn = indexer_prefill._prefill_scores_kernel
    types = _types(fn, {"q_ptr": "*fp32", "w_ptr": "*fp32", "keys_ptr": "*fp32", "key_start_ptr": "*i32",
                        "key_count_ptr": "*i32", "pos_ptr": "*i32", "out_ptr": "*fp32"}, ())
    yield ("indexer_prefill", "k3.1_Hi32_D128_fp32_keys", fn, types,
           dict(HI=32, D=128, BLOCK_S=64, PRECISION="tf32x3"), 8)
    yield ("indexer_prefill", "k3.1_Hi32_D128_bf16_keys", fn, {**types, "keys_ptr": "*bf16"},
           dict(HI=32, D=128, BLOCK_S=64, PRECISION="tf32"), 4)

    fn = router._select_kernel
    types = _types(fn, {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64"},
                   ("scaling",))
    yield ("router", "k3_E896_top16", fn, types,
           dict(E_PAD=1024, TOP_K=16, K_PAD=16, SIGMOID=True, HAS_BIAS=True, RENORMALIZE=True), 4)
    yield ("router", "k3_slice_E128_top16_w1", fn, types,
           dict(E_PAD=128, TOP_K=16, K_PAD=16, SIGMOID=True, HAS_BIAS=True, RENORMALIZE=True), 1)

    fn = router._logits_kernel
    types = _types(fn, {"w_ptr": "*fp32", "out_ptr": "*fp32"}, ())
    for block_t, block_d in ((1, 4096), (16, 256)):
        yield ("router", f"logits_T{block_t}_D7168", fn, types, dict(D=7168, BLOCK_T=block_t, BLOCK_D=block_d), 4)

    fn = moe_mxfp4_gemv._sum_choices_kernel
    yield ("moe_sum_choices", "top16_L3584", fn, _types(fn, {"y_ptr": "*fp32"}, ()),
           dict(TOPK=16, L=3584, BLOCK=1024), 4)

    fn = attn_res._attn_res_kernel
    types = _types(fn, {}, ("eps", "out_eps"))
    for block_d, warps in ((1024, 4), (4096, 8)):                       # attn_res.launch_options
        yield ("attn_res", "boundary_nvis8" + ("" if block_d == 1024 else f"_d{block_d}_w{warps}"), fn, types,
               dict(D=7168, NVIS=8, S_PAD=8, HAS_DELTA=True, HAS_WRITE=True, HAS_NORM=True, BLOCK_D=block_d), warps)

    fn = rms_norm._rms_norm_kernel
    types = _types(fn, {}, ("eps",))
    for d, block, warps in ((7168, 8192, 16), (3584, 4096, 16), (1536, 2048, 8), (512, 512, 2)):
        yield ("rms_norm", f"bf16_D{d}", fn, types, dict(D=d, BLOCK_D=block, HAS_WEIGHT=True), warps)

    fn = glu._glu_kernel
    types = _types(fn, {}, ("beta", "linear_beta"))
    yield ("glu", "bf16_situ_I1536", fn, types, dict(I=1536, BLOCK_I=1024, SITU=True, HAS_LINEAR_BETA=True), 4)

    fn = mla_decode._mla_split_kernel
    types = _types(fn, {"q_ptr": "*fp32", "table_ptr": "*i32", "lens_ptr": "*i64", "seq_of_ptr": "*i64",
                        "q_pos_ptr": "*i64", "sel_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32",
                        "kv_scale_ptr": "*fp32"}, ("scale",))
    for cache, sparse, native in (("*bf16", False, False), ("*fp8e4nv", False, False), ("*fp8e4nv", True, False),
                                  ("*bf16", False, True), ("*fp8e4nv", False, True)):
        yield ("mla_decode", f"kv{cache[1:]}{'_dsa' if sparse else ''}{'_native' if native else ''}", fn,
               {**types, "kv_ptr": cache}, dict(PAGE=64, R=512, DR=64, BLOCK_H=16, BLOCK_N=32, SPLIT_LEN=256,
                                                SPARSE=sparse, IEEE=False, NATIVE=native, WHOLE_MAX=True), 8)

    fn = mla_decode._merge_splits_kernel                 # merge="triton" (experimental)
    for out, hi_lo in (("*bf16", True), ("*fp32", False)):
        yield ("mla_merge", f"R512_S64_{out[1:]}", fn, _types(fn, {"out_ptr": out}, (), default_pointer="*fp32"),
               dict(R=512, S_PAD=64, R_CHUNK=64, HI_LO=hi_lo), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    rows = []
    for name, variant, fn, types, constexprs, warps in variants():
        rows.append({"kernel": name, "variant": variant, "num_warps": warps,
                     **compile_report(fn, types, constexprs, warps, MAX_REGISTERS.get((name, variant)))})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'kernel':<14} {'variant':<26} {'warps':>5} {'regs':>5} {'spill B':>8} {'smem B':>8} {'converts':>8} "
          f"{'barriers':>8}")
    for r in rows:
        print(f"{r['kernel']:<14} {r['variant']:<26} {r['num_warps']:>5} {r['registers']:>5} {r['spill_bytes']:>8} "
              f"{r['shared_bytes']:>8} {r['convert_layouts']:>8} {r['barriers']:>8}")


if __name__ == "__main__":
    main()
