"""W4A16 (`pack-quantized` int4) codec: bit layout, dequantisation and quantisation on small
arrays computed by hand, then round trips on fresh random inputs."""

import pytest
import torch

from k3.quant.int4_pack import int4_dequantize, int4_quantize, pack_int4, unpack_int4


def test_word_layout_by_hand():
    # nibble j of a word is column j, stored as q + 8: q = -8..-1 -> nibbles 0..7 -> 0x76543210;
    # q = 0..7 -> nibbles 8..15 -> 0xFEDCBA98, which is negative as an int32
    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int8)
    words = pack_int4(q)
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    assert words.tolist() == [[0x76543210, 0xFEDCBA98 - 2 ** 32]]
    assert torch.equal(unpack_int4(words), q)
    assert pack_int4(torch.zeros(1, 8, dtype=torch.int8)).item() == 0x88888888 - 2 ** 32


def test_random_words_match_a_python_bit_reading():
    g = torch.Generator().manual_seed(1)
    words = torch.randint(-2 ** 31, 2 ** 31, (5, 3), generator=g, dtype=torch.int64).to(torch.int32)
    q = unpack_int4(words)
    for r in range(5):
        for c in range(3):
            u = int(words[r, c]) & 0xFFFFFFFF
            assert q[r, 8 * c:8 * c + 8].tolist() == [((u >> (4 * j)) & 0xF) - 8 for j in range(8)]
    assert torch.equal(pack_int4(q), words)


def test_dequantize_by_hand():
    q = torch.tensor([[1, -2, 3, -4, 5, -6, 7, -8]], dtype=torch.int8)
    scales = torch.tensor([[0.5, 0.25]], dtype=torch.bfloat16)            # groups of 4 columns
    w = int4_dequantize(pack_int4(q), scales, dtype=torch.float32)
    assert w.tolist() == [[0.5, -1.0, 1.5, -2.0, 1.25, -1.5, 1.75, -2.0]]
    stacked = int4_dequantize(pack_int4(q).expand(3, 1, 1), scales.expand(3, 1, 2), dtype=torch.float64)
    assert stacked.shape == (3, 1, 8) and stacked.dtype == torch.float64 and torch.equal(stacked[2], w.double())


def test_dequantize_rounds_once_to_the_target_dtype():
    scale = torch.tensor([[1 + 2 ** -7]], dtype=torch.bfloat16)           # 7 * scale needs 10 significant bits
    q = torch.full((1, 8), 7, dtype=torch.int8)
    exact = int4_dequantize(pack_int4(q), scale, dtype=torch.float32)
    assert exact[0, 0].item() == 7 * (1 + 2 ** -7)
    assert torch.equal(int4_dequantize(pack_int4(q), scale, dtype=torch.bfloat16), exact.to(torch.bfloat16))


def test_quantize_rounds_the_quotient_in_the_weights_dtype():
    # bf16: amax 9 -> scale 9 / 7.5 = 1.2 -> 1.203125 in bf16; 3.015625 / 1.203125 = 2.5065
    # rounds to 2.5 in bf16, then half to even -> 2 (one rounding would give 3); 9 / 1.203125
    # = 7.48 -> 7.5 in bf16 -> 8, saturated to 7
    w = torch.tensor([[9.0, 3.015625, 0, 0, 0, 0, 0, 0]], dtype=torch.bfloat16)
    packed, scales = int4_quantize(w, 8)
    assert scales.tolist() == [[1.203125]] and scales.dtype == torch.bfloat16
    assert unpack_int4(packed).tolist() == [[7, 2, 0, 0, 0, 0, 0, 0]]
    assert round(3.015625 / 1.203125) == 3                                  # what one rounding would give


def test_quantize_by_hand():
    # amax 3.75 -> scale 0.5; w / 0.5 = 7.5, -7.5, 2.5, 0.5, 1.5, -1, 4, 0 -> half to even:
    # 8 (saturates to 7), -8, 2, 0, 2, -1, 4, 0
    w = torch.tensor([[3.75, -3.75, 1.25, 0.25, 0.75, -0.5, 2.0, 0.0]])
    packed, scales = int4_quantize(w, 8)
    assert scales.tolist() == [[0.5]] and scales.dtype == torch.float32
    assert unpack_int4(packed).tolist() == [[7, -8, 2, 0, 2, -1, 4, 0]]
    zero_packed, zero_scale = int4_quantize(torch.zeros(2, 16, dtype=torch.bfloat16), 8)
    assert zero_scale.dtype == torch.bfloat16 and torch.all(zero_scale == torch.finfo(torch.bfloat16).eps)
    assert torch.all(unpack_int4(zero_packed) == 0)


@pytest.mark.parametrize("group", [8, 32, 128])
def test_random_round_trip_error_is_half_a_step(group):
    g = torch.Generator().manual_seed(group)
    w = torch.randn(4, 16, 256, generator=g) * 0.05                          # [E, out, in]
    packed, scales = int4_quantize(w, group)
    assert packed.shape == (4, 16, 32) and scales.shape == (4, 16, 256 // group)
    dense = int4_dequantize(packed, scales)
    step = scales.repeat_interleave(group, dim=-1)
    assert torch.all((dense - w).abs() <= step / 2 + 1e-7)
    assert torch.all(dense.abs() <= 8 * step) and not torch.equal(dense, torch.zeros_like(dense))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="int32"):
        unpack_int4(torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.full((1, 8), 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="N % 8"):
        pack_int4(torch.zeros(1, 6, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"packed \(2, 4\) and scales \(2, 3\)"):
        int4_dequantize(torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, 3))
    with pytest.raises(ValueError, match="divisible by 32"):
        int4_quantize(torch.zeros(2, 48), 32)
