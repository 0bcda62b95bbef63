"""The ppu platform's MXFP4 -> bf16 dequantisation of routed experts (issue 26): the kernel the
torch-native experts run for every group of experts when they are not held dense
(platforms/torch_kernels/mxfp4_lut.py), at k3-slice's expert shapes, against the copy bandwidth.

    python3 bench/ppu_dequant.py --out ppu_dequant.json          # CUDA
    python3 bench/ppu_dequant.py --smoke --out s.json            # CPU: tiny shapes, eager forms only

Forms, each writing g experts' w13 ([2I, L]) and w2 ([L, I]) into NaN-poisoned bf16 buffers
through a device index (the slots way's routed experts):
  - `eager_table`: the two eager passes through the 65,536-entry scaled byte table (what a
    device without torch.compile runs: a PPU without Triton);
  - `compiled_table`, `compiled_decode`, `compiled_bits`: mxfp4_lut.CompiledDecoder's forms
    (`table_into`, `decode_into`, `decode_bits_into`) as served, dynamic shapes;
  - `compiled_table_copy`, `compiled_decode_stack`: the table and decode_into as first compiled
    (a bitcast of out inside the function; the nibbles by torch.stack), the peers;
  - `*_static`: compiled for each shape; `*_per_expert`: one static call an expert.
`--forms` picks some; on the CPU (`--smoke`) the decoders run eagerly instead.
Every form is checked bit for bit against `k3.quant.mxfp4` (NaN where it is NaN) before it is
timed. Bytes: the codes and scales read plus the bf16 weights written (2.5 bytes a weight, the
least any form moves), as a fraction of the measured copy bandwidth (read + write of 1 GiB).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

from k3.platforms.torch_kernels.mxfp4_lut import (COMPILED_FORM, COMPILED_FORMS, CompiledDecoder, decode_bits_into,
                                                  decode_tables, decode_with_tables, lut_dequantize,
                                                  scaled_byte_table, table_into)
from k3.quant.mxfp4 import MXFP4_BLOCK, MXFP4Tensor


def decode_stack_into(out, packed, scales, code_values, scale_values, index=None):
    """`decode_into` as first served (2026-12-07): the nibbles by torch.stack, which inductor
    stores as an int32 buffer before the lookups (mxfp4_lut._nibbles)."""
    if index is not None:
        packed, scales = packed.index_select(0, index), scales.index_select(0, index)
    n, rows, blocks = scales.shape
    byte = packed.reshape(n, rows, blocks, MXFP4_BLOCK // 2).to(torch.int32)
    nibbles = torch.stack([byte & 15, byte >> 4], dim=-1)                                 # [n, R, C/32, 16, 2]
    scale = scale_values[scales.to(torch.int32)].view(n, rows, blocks, 1, 1)
    out.view(nibbles.shape).copy_(code_values[nibbles] * scale)
    return out


def table_copy_into(out, packed, scales, table, index=None):
    """`mxfp4_lut.table_into` as first compiled (until 2026-12-08): out bitcast to the word dtype
    inside the compiled function, which inductor gathered into a buffer and then copied."""
    return table_into(out.view(table.dtype), packed, scales, table, index)


# One wrapper a compiled form: dynamo keys its compiled graphs (and its automatic-dynamic state)
# on the top frame's code object, so each form compiles on its own.
def _table_copy(out, packed, scales, index):
    return table_copy_into(out, packed, scales, scaled_byte_table(out.dtype, out.device), index)


def _stack_dynamic(out, packed, scales, index):
    return decode_stack_into(out, packed, scales, *decode_tables(out.dtype, out.device), index)


def _decode_static(out, packed, scales, index):
    return decode_with_tables(out, packed, scales, index)


def _decode_expert(out, packed, scales, index):
    return decode_with_tables(out, packed, scales, index)


def _bits_static(out, packed, scales, index):
    return decode_bits_into(out, packed, scales, index)


def _bits_expert(out, packed, scales, index):
    return decode_bits_into(out, packed, scales, index)


def compiled_forms() -> dict:
    """name -> fn(out, packed, scales, index): the compiled forms (module docstring)."""
    for name in ("recompile_limit", "cache_size_limit"):     # static forms compile once per g and matrix
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)

    def per_expert(fn):
        expert = torch.compile(fn, dynamic=False)

        def call(out, packed, scales, index):
            for i in range(out.shape[0]):          # [1, R, C] a call: one static graph per matrix
                expert(out[i:i + 1], packed, scales, index[i:i + 1])
            return out
        return call

    table_copy = torch.compile(table_copy_into, dynamic=True)
    return {"compiled_table": CompiledDecoder("table"),
            "compiled_decode": CompiledDecoder("decode"),
            "compiled_bits": CompiledDecoder("bits"),
            "compiled_table_copy": torch.compile(_table_copy, dynamic=True),
            "compiled_decode_stack": torch.compile(_stack_dynamic, dynamic=True),
            "compiled_decode_static": torch.compile(_decode_static, dynamic=False),
            "compiled_bits_static": torch.compile(_bits_static, dynamic=False),
            "compiled_decode_per_expert": per_expert(_decode_expert),
            "compiled_bits_per_expert": per_expert(_bits_expert)}


def random_experts(e: int, rows: int, cols: int, device: str, seed: int) -> MXFP4Tensor:
    """Uniform code bytes and the scale bytes of trained weights (2^-10 .. 2^-4 around 2^-7)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, rows, cols // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(117, 124, (e, rows, cols // MXFP4_BLOCK), dtype=torch.uint8, generator=g)
    return MXFP4Tensor(packed.to(device), scales.to(device))


def timed_ms(fn, device: str, reps: int) -> float:
    if device == "cuda":
        from measure import bench_ms

        return bench_ms(fn)
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="ppu_dequant.json")
    parser.add_argument("--experts", type=int, nargs="+", default=[1, 4, 8], help="g: experts a call")
    parser.add_argument("--forms", nargs="+", help="time only these forms (default: every one)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    e_total, hidden, inter = (8, 64, 96) if args.smoke else (128, 3584, 3072)     # k3-slice: L 3584, I 3072
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "served_form": COMPILED_FORM,
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "shapes": {"experts": e_total, "hidden": hidden, "intermediate": inter}, "rows": []}
    if device == "cuda":
        from measure import copy_bandwidth_GBps

        result["copy_GBps"] = copy_GBps = copy_bandwidth_GBps()
    else:
        copy_GBps = None
    forms = {"eager_table": None}
    if device == "cuda":
        forms.update(compiled_forms())
    else:                                     # the CPU smoke: the same functions, not compiled
        forms["decode_eager"] = _decode_static
        forms["bits_eager"] = _bits_static
        forms["stack_eager"] = _stack_dynamic
        forms["table_copy_eager"] = _table_copy
    if args.forms:
        forms = {name: fn for name, fn in forms.items() if name in args.forms}
    for name, (rows, cols) in {"w13": (2 * inter, hidden), "w2": (hidden, inter)}.items():
        w = random_experts(e_total, rows, cols, device, seed=len(name))
        for g in args.experts:
            index = torch.randperm(e_total, generator=torch.Generator().manual_seed(g))[:g].to(device)
            want = MXFP4Tensor(w.packed[index], w.scales[index]).dequantize(torch.bfloat16)
            out = torch.empty(g, rows, cols, dtype=torch.bfloat16, device=device)
            nbytes = g * rows * cols * 2.5
            for form, fused in forms.items():
                if fused is None:
                    call = lambda: lut_dequantize(w, out, index=index)                      # noqa: E731
                else:
                    call = lambda: fused(out, w.packed, w.scales, index)                    # noqa: E731
                out.fill_(float("nan"))
                call()
                exact = bool(torch.equal(out.isnan(), want.isnan())
                             and torch.equal(out[~want.isnan()], want[~want.isnan()]))
                ms = timed_ms(call, device, reps=3)
                row = {"matrix": name, "experts": g, "form": form, "exact": exact, "ms": ms,
                       "GBps": nbytes / ms / 1e6}
                if copy_GBps:
                    row["fraction_of_copy"] = row["GBps"] / copy_GBps
                result["rows"].append(row)
                print(f"{name} g={g} {form:16s} {'ok' if exact else 'WRONG'} {ms * 1e3:9.1f} us "
                      f"{row['GBps']:8.1f} GB/s" + (f" {row['fraction_of_copy']:.0%} of copy" if copy_GBps else ""),
                      flush=True)
    # CompiledDecoder's forms by their summed time over the rows: bench/ppu_h200.sh's dequant phase
    # then runs the engine with the served one and with the fastest (K3_MXFP4_COMPILED_FORM)
    totals = {form: sum(r["ms"] for r in result["rows"] if r["form"] == f"compiled_{form}" and r["exact"])
              for form in COMPILED_FORMS
              if any(r["form"] == f"compiled_{form}" and r["exact"] for r in result["rows"])}
    if totals:
        result["compiled_form_ms"] = totals
        result["fastest_form"] = min(totals, key=totals.get)
        print("compiled forms, summed ms:", {form: round(ms, 3) for form, ms in totals.items()}, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    if not all(r["exact"] for r in result["rows"]):
        raise SystemExit("a form decoded a weight wrong")


if __name__ == "__main__":
    main()
