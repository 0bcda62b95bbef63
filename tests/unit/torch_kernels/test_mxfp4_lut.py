"""The torch-native experts' MXFP4 dequantisation (platforms/torch_kernels/mxfp4_lut.py): every
(scale byte, code byte) pair decodes bit for bit as k3.quant.mxfp4_dequantize does (NaN for scale
255, inf past the dtype's range), into a NaN-poisoned output, from a slice or an index of experts."""

import pytest
import torch

from k3.platforms.torch_kernels.mxfp4_lut import (CompiledDecoder, decode_bits_into, decode_with_tables,
                                                  lut_dequantize, scaled_byte_table)
from k3.quant.mxfp4 import MXFP4Tensor


def _every_pair() -> MXFP4Tensor:
    """3 experts [64, 512]: each row holds every code byte, each 32-value block its own scale
    byte; across the 192 rows x 16 blocks every scale byte appears with every code byte."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(3 * 64, 1).reshape(3, 64, 256)
    scales = torch.arange(3 * 64 * 16).remainder(256).to(torch.uint8).reshape(3, 64, 16)
    return MXFP4Tensor(codes, scales)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """NaN exactly where want is NaN and every other value bit for bit (a compiled kernel's NaN
    payload is its code generator's: a GPU writes the canonical NaN)."""
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(_bits(got[~nan]), _bits(want[~nan]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
def test_every_scale_and_code_byte_decodes_exactly(dtype):
    w = _every_pair()
    want = w.dequantize(dtype)
    assert want.isnan().any() and (want != 0).any()                                # the extremes are covered
    assert bool(want.isinf().any()) == (dtype != torch.float64)                   # 6 * 2^127 overflows all but fp64
    out = torch.full((3, 64, 512), float("nan"), dtype=dtype)
    lut_dequantize(w, out)
    assert torch.equal(_bits(out), _bits(want))                                   # NaN payloads included
    part = torch.full((2, 64, 512), float("nan"), dtype=dtype)
    lut_dequantize(w, part, start=1)
    assert torch.equal(_bits(part), _bits(want[1:]))
    lut_dequantize(w, part.fill_(float("nan")), index=torch.tensor([2, 0]))
    assert torch.equal(_bits(part), _bits(want[[2, 0]]))


def test_random_experts_and_the_table_size():
    g = torch.Generator().manual_seed(4)
    w = MXFP4Tensor.from_float(torch.randn(5, 32, 96, generator=g))
    out = torch.full((5, 32, 96), float("nan"), dtype=torch.bfloat16)
    assert torch.equal(lut_dequantize(w, out), w.dequantize(torch.bfloat16))
    table = scaled_byte_table(torch.bfloat16, "cpu")
    assert table.dtype == torch.int32 and table.shape == (65536,)                 # 256 KiB: two bf16 a word


def test_a_wrong_out_is_refused():
    w = _every_pair()
    with pytest.raises(ValueError, match="contiguous"):
        lut_dequantize(w, torch.empty(3, 512, 64).transpose(1, 2))
    with pytest.raises(ValueError, match="contiguous"):
        lut_dequantize(w, torch.empty(3, 64, 256))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_fused_lookup_gives_the_same_bits(dtype):
    """`decode_into` (over its tables: `decode_with_tables`), one of the functions torch.compile
    fuses where the device compiles (the fused argument), run eagerly, decodes every (scale, code) pair as the two eager passes of the big
    table do: whole stack, slice and index, into NaN-poisoned outputs."""
    w = _every_pair()
    want = w.dequantize(dtype)
    out = torch.full((3, 64, 512), float("nan"), dtype=dtype)
    assert torch.equal(_bits(lut_dequantize(w, out, fused=decode_with_tables)), _bits(want))
    part = torch.full((2, 64, 512), float("nan"), dtype=dtype)
    assert torch.equal(_bits(lut_dequantize(w, part, start=1, fused=decode_with_tables)), _bits(want[1:]))
    part.fill_(float("nan"))
    assert torch.equal(_bits(lut_dequantize(w, part, index=torch.tensor([2, 0]), fused=decode_with_tables)),
                       _bits(want[[2, 0]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_the_table_free_decoder_gives_the_same_values(dtype):
    """`decode_bits_into` builds each nibble's and each scale byte's fp32 pattern by integer
    arithmetic: every (scale, code) pair decodes as the reference does (subnormal 2^-127, NaN
    for 255, inf past the range, -0 for the negative zero code), whole stack and by index."""
    w = _every_pair()
    want = w.dequantize(dtype)
    out = torch.full((3, 64, 512), float("nan"), dtype=dtype)
    assert _same_values(decode_bits_into(out, w.packed, w.scales), want)
    part = torch.full((2, 64, 512), float("nan"), dtype=dtype)
    assert _same_values(decode_bits_into(part, w.packed, w.scales, torch.tensor([2, 0])), want[[2, 0]])
    with pytest.raises(ValueError, match="float64"):
        decode_bits_into(torch.empty(3, 64, 512, dtype=torch.float64), w.packed, w.scales)


@pytest.mark.parametrize("form", ["table", "decode", "bits"])
def test_the_compiled_decoders_give_the_same_values(form):
    """What the GPU runs is a `CompiledDecoder`: inductor's lowering of each form (its C++ code
    generator here, one compile of about 10 s) must give the reference's values, for the whole
    stack, a slice and through a device index, into NaN-poisoned outputs (NaN where the
    reference is); a float64 output (no word table, no fp32 patterns) takes decode_into eagerly."""
    w = _every_pair()
    fused = CompiledDecoder(form)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        want = w.dequantize(dtype)
        out = torch.full((3, 64, 512), float("nan"), dtype=dtype)
        assert _same_values(lut_dequantize(w, out, fused=fused), want)
        part = torch.full((2, 64, 512), float("nan"), dtype=dtype)
        assert _same_values(lut_dequantize(w, part, start=1, fused=fused), want[1:])
        assert _same_values(lut_dequantize(w, part.fill_(float("nan")), index=torch.tensor([2, 0]), fused=fused),
                            want[[2, 0]])
    with pytest.raises(ValueError, match="form"):
        CompiledDecoder("nibble")


@pytest.mark.parametrize("form", ["table", "decode", "bits"])
def test_each_compiled_form_is_one_kernel_with_no_buffer_of_its_own(form):
    """The bytes a compiled form moves are what inductor makes of it: each must be one fused
    kernel that allocates nothing (a torch.stack of the nibbles became an int32 buffer, and a
    bitcast of out inside the function a gathered copy: 8 and 4 more bytes a weight, measured
    slower on an H100). Read from inductor's generated code (its CPU code generator; the buffers
    are decided before the device's code is)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()                                   # compile afresh, so the code is captured
    w = _every_pair()
    out = torch.full((2, 64, 512), float("nan"), dtype=torch.bfloat16)
    _, codes = run_and_get_code(CompiledDecoder(form), out, w.packed, w.scales, torch.tensor([2, 0]))
    code = "\n".join(codes)
    assert code.count("async_compile.cpp_pybinding(") == 1, code
    assert "empty_strided" not in code.split("def call(")[-1], code
    assert _same_values(out, w.dequantize(torch.bfloat16)[[2, 0]])


def test_the_w4a16_entry_fuses_the_lookup_only_where_it_compiles():
    from k3.platforms.torch_kernels.moe_w4a16 import W4A16Experts

    assert W4A16Experts(grouped=False, compiled=False)._lookup is None
    assert W4A16Experts(grouped=False, compiled=True)._lookup is not None


def test_tile_major_experts_decode_as_their_checkpoint_layout():
    """A platform's tile-major repack (k3.quant.mxfp4_tiles) reaching the torch kernels: the
    selected experts are untiled first, so a slice or an index decodes to the same weights."""
    from k3.quant.mxfp4_tiles import to_tile_major

    g = torch.Generator().manual_seed(5)
    w = MXFP4Tensor.from_float(torch.randn(3, 128, 128, generator=g))
    tiles = to_tile_major(w)
    want = w.dequantize(torch.bfloat16)
    out = torch.full((3, 128, 128), float("nan"), dtype=torch.bfloat16)
    assert torch.equal(lut_dequantize(tiles, out), want)
    part = torch.full((2, 128, 128), float("nan"), dtype=torch.bfloat16)
    assert torch.equal(lut_dequantize(tiles, part, start=1), want[1:])
    assert torch.equal(lut_dequantize(tiles, part.fill_(float("nan")), index=torch.tensor([2, 0])), want[[2, 0]])
    part.fill_(float("nan"))
    assert torch.equal(lut_dequantize(tiles, part, index=torch.tensor([0, 2]), fused=decode_with_tables), want[[0, 2]])
