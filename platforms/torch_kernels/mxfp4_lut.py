"""MXFP4 -> dense in eager torch through one lookup a packed byte, the scale folded into the
table: what the torch-native experts (`moe_w4a16`) dequantise with when the routed experts are
not held dense.

The table has 65,536 entries, one per (E8M0 scale byte s, packed code byte b): the two values
(E2M1(b & 15), E2M1(b >> 4)) * 2^(s - 127), computed exactly in float64 and rounded once to the
target dtype (what `k3.quant.mxfp4.mxfp4_dequantize` gives: exact in bf16 / fp32 within their
range, inf past it, NaN for s = 255). For a 2- or 4-byte dtype an entry is one integer word
(int32 / int64) holding both values, the first in the low half (little-endian), so a gather of
words writes the dense row directly. Two passes over each weight:

    idx = packed (uint8, viewed [.., C/32, 16]) + 256 * scale (int32 [.., C/32, 1])   0.5 B in, 2 B out
    out.view(word) = table[idx]                                                         2 B in, 2 B out

6.5 bytes a weight (bf16 out) in two kernels, against ~11.5 in five for the nibble table plus a
scale multiply it replaces; int32 indices only. The table (256 KiB in bf16) is built on a
device's first call, before any graph capture (the decode-graph warm-up calls run first).

Where the device compiles (torch.compile), `CompiledDecoder` compiles one of three forms as one
function (`COMPILED_FORM`, `$K3_MXFP4_COMPILED_FORM`):
- "table" (served): `table_into`, the two passes above as one kernel, gathering the words straight
  into out bitcast to the word dtype (bitcast inside the compiled function, inductor gathered into
  a buffer and copied it: the form measured on the H100, 4 more bytes a weight);
- "decode": `decode_into`, each nibble through a 16-entry value table and each scale byte through
  a 256-entry power-of-two table (both cached close to the cores), multiplied in fp32 (exact: a
  2-bit significand times a power of two, subnormals included) and rounded once to the output
  dtype, so it gives the big table's bits; 2.5 bytes a weight, streamed;
- "bits": `decode_bits_into`, the same values with no table (the fp32 patterns built by integer
  arithmetic: no indirect load).
On an H100 (bench/ppu_dequant.py, BENCHMARKS.md) the first decode_into ran at 5-10% of the copy
bandwidth against the table's 12-16%: inductor stored its torch.stack of the nibbles as an int32
buffer. The nibbles are now a broadcast shift (`_nibbles`); the streaming forms replace the table
once a GPU run shows them faster.
"""

from __future__ import annotations

import os
import sys

import torch

from k3.quant.mxfp4 import MXFP4_BLOCK, MXFP4Tensor
from k3.quant.mxfp4_tiles import TileMajorMXFP4

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_WORD = {2: torch.int32, 4: torch.int64}        # two values of this itemsize in one integer word
_TABLES: dict[tuple[torch.dtype, str], torch.Tensor] = {}
_DECODE_TABLES: dict[tuple[torch.dtype, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _code_values() -> torch.Tensor:
    """E2M1 code c's value, c = 0..15 (bit 3 the sign): float64 [16]."""
    return torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float64)


def _scale_values() -> torch.Tensor:
    """E8M0 scale byte s's multiplier 2^(s - 127), NaN for 255: float64 [256]."""
    return torch.tensor([2.0 ** (s - 127) for s in range(255)] + [float("nan")], dtype=torch.float64)


def scaled_byte_table(dtype: torch.dtype, device) -> torch.Tensor:
    """[65536] words (2- and 4-byte dtypes) or [65536, 2] values (float64): entry s * 256 + b
    holds the two values byte b codes under scale byte s (module docstring). Cached per (dtype,
    device)."""
    key = (dtype, str(torch.device(device)))
    if key not in _TABLES:
        if sys.byteorder != "little":
            raise RuntimeError("mxfp4_lut: the word table assumes a little-endian host")
        codes, e2m1 = torch.arange(256), _code_values()
        pair = torch.stack([e2m1[codes & 15], e2m1[codes >> 4]], -1)                       # [256 b, 2]
        scale = _scale_values()
        values = (scale[:, None, None] * pair[None]).reshape(65536, 2).to(dtype)           # [s * 256 + b, 2]
        word = _WORD.get(dtype.itemsize)
        table = values.view(word).reshape(65536) if word is not None else values
        _TABLES[key] = table.to(device)
    return _TABLES[key]


def _table_index(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int32 [n, R, C/32, 16]: each code byte's entry in `scaled_byte_table`, scale byte * 256 +
    code byte, for packed [n, R, C/2] and scales [n, R, C/32] (one int32 copy of the scales;
    the codes are promoted by the add)."""
    n, rows, blocks = scales.shape
    shift = scales.to(torch.int32).mul_(256).view(n, rows, blocks, 1)                      # [n, R, C/32, 1]
    return torch.add(packed.reshape(n, rows, blocks, MXFP4_BLOCK // 2), shift)


def decode_tables(dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(code values [16], scale values [256]) in `decode_into`'s product dtype (float64 for a
    float64 output, else float32): E2M1 code c's value, and 2^(s - 127) for scale byte s (NaN
    for 255, E8M0's NaN). Cached per (product dtype, device)."""
    product = torch.float64 if dtype == torch.float64 else torch.float32
    key = (product, str(torch.device(device)))
    if key not in _DECODE_TABLES:                        # 2^-127 becomes an fp32 subnormal, exactly
        _DECODE_TABLES[key] = tuple(t.to(product).to(device) for t in (_code_values(), _scale_values()))
    return _DECODE_TABLES[key]


def _nibbles(packed: torch.Tensor, n: int, rows: int, blocks: int) -> torch.Tensor:
    """int32 [n, R, C/32, 16, 2]: byte j's low nibble, then its high one, as a broadcast shift
    of the bytes by (0, 4). A pointwise expression inductor fuses into its consumer; a
    torch.stack of the two nibbles is lowered to a concatenation, which inductor stores as an
    int32 buffer (8 bytes a weight written and read back)."""
    byte = packed.reshape(n, rows, blocks, MXFP4_BLOCK // 2, 1).to(torch.int32)          # [n, R, C/32, 16, 1]
    return (byte >> torch.arange(0, 8, 4, dtype=torch.int32, device=packed.device)) & 15


def decode_into(out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, code_values: torch.Tensor,
                scale_values: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """The big table's result (`lut_dequantize`) by arithmetic a torch.compile kernel streams (module docstring):
    out [n, R, C] (contiguous) = the experts `index` of packed [E, R, C/2] / scales [E, R, C/32]
    (all of them when index is None), value = code_values[nibble] * scale_values[scale byte]
    (`decode_tables`), element 2j from byte j's low nibble. Returns `out`."""
    if index is not None:
        packed, scales = packed.index_select(0, index), scales.index_select(0, index)
    n, rows, blocks = scales.shape
    nibbles = _nibbles(packed, n, rows, blocks)                                           # [n, R, C/32, 16, 2]
    scale = scale_values[scales.to(torch.int32)].view(n, rows, blocks, 1, 1)
    out.view(nibbles.shape).copy_(code_values[nibbles] * scale)                           # one rounding, to out
    return out


def decode_with_tables(out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                       index: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_into` over `decode_tables` for out's dtype and device: `lut_dequantize`'s fused
    contract, fn(out, packed, scales, index), run eagerly. Returns `out`."""
    return decode_into(out, packed, scales, *decode_tables(out.dtype, out.device), index)


def decode_bits_into(out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                     index: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_into` with no table: each nibble's fp32 bit pattern and each scale byte's are built
    by integer arithmetic, so a compiled kernel makes no indirect load. out [n, R, C] (contiguous,
    bf16 / fp16 / fp32) = the experts `index` of packed [E, R, C/2] / scales [E, R, C/32] (all of
    them when index is None); bit-identical to `lut_dequantize`. Returns `out`.

    E2M1 code c = s e1 e0 m: |value| = m / 2 for e = 0, else 2^(e - 1) (1 + m / 2), whose fp32
    pattern is ((e + 126) << 23) | (m << 22); 0.5 is (126 << 23). E8M0 byte s: 2^(s - 127) is
    s << 23 for s in 1..254, the subnormal 0x00400000 for s = 0, NaN for 255. The product of the
    two fp32 values is exact; the copy into out rounds it once."""
    if out.dtype == torch.float64:
        raise ValueError("decode_bits_into: float64 output takes decode_into")
    if index is not None:
        packed, scales = packed.index_select(0, index), scales.index_select(0, index)
    n, rows, blocks = scales.shape
    code = _nibbles(packed, n, rows, blocks)                                              # [n, R, C/32, 16, 2]
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = torch.where(exponent == 0, mantissa * (126 << 23), ((exponent + 126) << 23) | (mantissa << 22))
    value = (magnitude | ((code >> 3) << 31)).view(torch.float32)
    s = scales.to(torch.int32)
    scale_bits = torch.where(s == 0, 0x00400000, torch.where(s == 255, 0x7FC00000, s << 23))
    scale = scale_bits.view(torch.float32).view(n, rows, blocks, 1, 1)
    out.view(code.shape).copy_(value * scale)                                             # one rounding, to out
    return out


def table_into(words: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, table: torch.Tensor,
               index: torch.Tensor | None = None) -> torch.Tensor:
    """The big table's two passes as one function of tensors, for torch.compile: the (scale,
    byte) index, then a gather of `scaled_byte_table` words into `words`, the output [n, R, C]
    (contiguous, a 2- or 4-byte dtype) viewed as the table's word dtype ([n, R, C/2]) by the
    caller. Bitcast outside the compiled function, so inductor writes the gather straight into
    it: given out itself and a `.view(word)` inside, it gathered into a buffer of its own and
    copied that into out (4 more bytes a weight). Returns `words`."""
    if index is not None:
        packed, scales = packed.index_select(0, index), scales.index_select(0, index)
    idx = _table_index(packed, scales)                                                    # [n, R, C/32, 16]
    words.view(idx.shape).copy_(table[idx])
    return words


# The form CompiledDecoder compiles (the module docstring). On an H100 (bench/ppu_dequant.py,
# 2026-12-07) the table took 147 / 68 us for one expert's w13 / w2, the first decode_into 350 / 178.
COMPILED_FORMS = ("table", "decode", "bits")
COMPILED_FORM = os.environ.get("K3_MXFP4_COMPILED_FORM", "table")     # an override for measuring the others


class CompiledDecoder:
    """`lut_dequantize`'s fused argument where the device compiles: fn(out, packed, scales, index)
    -> out, one torch.compile'd function (dynamic shapes) of the chosen form: "table"
    (`table_into` over `scaled_byte_table`), "decode" (`decode_into` over `decode_tables`) or
    "bits" (`decode_bits_into`). Each is one kernel that writes out directly, with no transient
    buffer (inductor's code on the CPU; the table since its words are bitcast outside)."""

    def __init__(self, form: str = COMPILED_FORM):
        if form not in COMPILED_FORMS:
            raise ValueError(f"CompiledDecoder: form must be one of {COMPILED_FORMS} (the default comes from "
                             f"$K3_MXFP4_COMPILED_FORM), got {form!r}")
        self.form = form
        self._fn = torch.compile({"table": table_into, "decode": decode_into, "bits": decode_bits_into}[form],
                                 dynamic=True)

    def __call__(self, out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 index: torch.Tensor | None) -> torch.Tensor:
        if self.form == "table" and out.dtype.itemsize in _WORD:
            table = scaled_byte_table(out.dtype, out.device)
            self._fn(out.view(table.dtype), packed, scales, table, index)
            return out
        if self.form == "bits" and out.dtype != torch.float64:
            return self._fn(out, packed, scales, index)
        if self.form == "decode":
            return self._fn(out, packed, scales, *decode_tables(out.dtype, out.device), index)
        return decode_with_tables(out, packed, scales, index)                             # fp64: eager


def lut_dequantize(w: MXFP4Tensor, out: torch.Tensor, *, start: int = 0,
                   index: torch.Tensor | None = None, fused=None) -> torch.Tensor:
    """Experts of the stacked MXFP4 `w` ([E, R, C] logical) written densely into `out`
    ([n, R, C], contiguous, any float dtype): w[start:start + n], or w[index] (a device index
    tensor of n experts: no host read). fused: fn(out, packed, scales, index) -> out, a
    `CompiledDecoder` where the device compiles (`moe_w4a16.build_experts`), or None for the two
    eager passes of the big table. Returns `out`."""
    n, rows, cols = out.shape
    if not out.is_contiguous() or tuple(w.shape[1:]) != (rows, cols):
        raise ValueError(f"lut_dequantize: out must be contiguous [n, {w.shape[1]}, {w.shape[2]}], "
                         f"got {tuple(out.shape)}")
    if isinstance(w, TileMajorMXFP4):   # a platform's tile-major repack: the selected experts untiled (a copy)
        w = w.checkpoint_layout(index if index is not None else slice(start, start + n))
        start, index = 0, None
    if index is None:
        packed, scales = w.packed[start:start + n], w.scales[start:start + n]             # views: no copy
    elif fused is None:
        packed, scales = w.packed.index_select(0, index), w.scales.index_select(0, index)
    else:
        packed, scales = w.packed, w.scales                                               # the fused gather selects
    if fused is not None:
        return fused(out, packed, scales, index)
    table = scaled_byte_table(out.dtype, out.device)
    idx = _table_index(packed, scales)                                                    # int32 [n, R, C/32, 16]
    if table.dim() == 1:
        torch.index_select(table, 0, idx.view(-1), out=out.view(table.dtype).view(-1))
    else:
        torch.index_select(table, 0, idx.view(-1), out=out.view(-1, 2))
    return out
