"""Instructions a weight in the k-loop of the MXFP4 MoE tensor-core tiles, compiled for the H200
(sm_90a) on any machine, no GPU needed (issue 27).

    python3 bench/moe_sass_census.py [--out moe_sass_census.json]

Triton lowers the gate/up kernel (`moe_mxfp4._gate_up_kernel`) for each form and tile, the ptxas
in Triton's wheel assembles it and cuobjdump disassembles it; the loop is the longest run of SASS
that ends in a backward branch. Instructions a weight = loop instructions / (gate + up rows x
columns a step / threads). At 16-64 decode tokens every expert's weights are decoded once a step
whatever the token count, so at the H200's issue rate (132 SMs x 4 schedulers x 1.98 GHz x 32
lanes) this count bounds the tile's time from below: `issue_bound_us_T64` is the time to issue
the loop for all 128 k3-slice experts (4.2 G weights), against the weight-bytes floor of
~530 us. Forms: dot_scaled (MODE 0, Triton's upcast), decode_bf16 by fp32 bit placement (2), by
PTX on bf16 pairs (3), and by PTX with the 2^126 bias folded into the scale (4).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re

import triton

from ptxas_report import _types, assemble

FORMS = {0: "dot_scaled", 2: "decode_bf16 bits", 3: "decode_bf16 ptx", 4: "decode_bf16 folded ptx"}
# (form, rows, tokens, columns a step, warps, stages, pipelined loads[, tiled layout]): the served dot_scaled
# tile first; then the same tiles with the scale and activation loads where they are used (before issue 27's
# fix); last, two tiles reading moe_mxfp4_layout's tile-major copy
TILES = ((0, 128, 16, 64, 8, 3, True), (0, 128, 16, 128, 8, 3, True), (2, 128, 16, 64, 8, 3, True),
         (3, 128, 16, 64, 8, 3, True), (3, 128, 16, 128, 8, 3, True), (3, 64, 16, 128, 4, 4, True),
         (4, 128, 16, 64, 8, 3, True), (4, 128, 16, 128, 8, 3, True),
         (0, 128, 16, 64, 8, 3, False), (3, 128, 16, 64, 8, 3, False), (4, 128, 16, 64, 8, 3, False),
         (4, 128, 16, 64, 8, 3, True, True), (0, 128, 16, 64, 8, 3, True, True))
WEIGHTS_T64 = 128 * 3 * 3072 * 3584           # k3-slice: every expert's w13 and w2
ISSUE_RATE = 132 * 4 * 1.98e9 * 32            # thread-instructions a second, H200


def loop_census(sass: str) -> dict:
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    address = lambda line: int(re.match(r"\s+/\*([0-9a-f]{4})\*/", line).group(1), 16)  # noqa: E731
    body = []
    for line in lines:
        branch = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", line)
        if branch and int(branch.group(1), 16) < address(line):
            run = [x for x in lines if int(branch.group(1), 16) <= address(x) <= address(line)]
            body = run if len(run) > len(body) else body
    ops: dict[str, int] = {}
    for line in body:
        op = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line).group(1).split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    return {"loop_instructions": len(body), "top_opcodes": dict(sorted(ops.items(), key=lambda o: -o[1])[:8])}


def compile_tile(mode, rows, tokens, cols, warps, stages, pipelined, tiled=False) -> dict:
    from k3.platforms.triton_kernels import moe_mxfp4

    fn = moe_mxfp4._gate_up_kernel
    types = _types(fn, {"p13_ptr": "*u8", "s13_ptr": "*u8", "tile_expert_ptr": "*i32", "tile_start_ptr": "*i32",
                        "order_ptr": "*i32", "start_ptr": "*i32", "count_ptr": "*i32", "act_ptr": "*bf16",
                        "delta_ptr": "*fp32"}, ("beta", "linear_beta"))
    constants = dict(L=3584, I=3072, SITU=True, HAS_LINEAR_BETA=False, IEEE=False, ROUND_ACT=1, ROUND_PRODUCTS=1,
                     HAS_DELTA=False, MODE=mode, BLOCK_T=tokens, BLOCK_N=rows, BLOCK_K=cols, PIPELINED=pipelined,
                     TILED=tiled, SCALES_AHEAD=pipelined)
    kernel, report, sass = assemble(fn, types, constants, warps, stages, disassemble=True)
    census = loop_census(sass)
    weights_a_thread = 2 * rows * cols / (32 * warps)
    per_weight = census["loop_instructions"] / weights_a_thread
    ptx = kernel.asm["ptx"]
    loop_ptx = ptx[ptx.index("Inner Loop"):] if "Inner Loop" in ptx else ""
    return {"form": FORMS[mode], "tile": f"n{rows}_t{tokens}_k{cols}_w{warps}_s{stages}", "pipelined_loads": pipelined,
            "tiled_layout": tiled,
            "registers": int(re.search(r"Used (\d+) registers", report).group(1)), "shared_bytes": kernel.metadata.shared,
            "synchronous_global_loads_in_loop": loop_ptx.count("ld.global"),
            **census, "instructions_a_weight": round(per_weight, 2),
            "issue_bound_us_T64": round(WEIGHTS_T64 * per_weight / ISSUE_RATE * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="moe_sass_census.json")
    args = parser.parse_args()
    rows = [compile_tile(*tile) for tile in TILES]
    for r in rows:
        print(f"{r['form']:<24} {r['tile']:<22} {'pipelined' if r['pipelined_loads'] else 'in-loop  '} "
              f"{'tiled' if r['tiled_layout'] else 'rows '} "
              f"{r['synchronous_global_loads_in_loop']} ld.global {r['registers']:>4} regs {r['loop_instructions']:>5} loop "
              f"{r['instructions_a_weight']:>5} a weight  issue bound at T=64 {r['issue_bound_us_T64']:>7} us  "
              f"{r['top_opcodes']}")
    with open(args.out, "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "target": "sm_90a (offline)",
                   "triton": triton.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
