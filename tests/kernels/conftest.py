"""Triton kernels on the CPU through Triton's interpreter, at tiny shapes, against the
reference ops. TRITON_INTERPRET must be set before a kernel module is imported (Triton reads
it when a kernel is decorated), so it is set here, at collection.

What the interpreter cannot show, and the GPU conformance run must: races between threads of
one program (the interpreter runs a program's lanes in lockstep, one program at a time).
Triton 3.6's interpreter also truncates fp32 -> bf16 casts where the GPU rounds to nearest even
(`cvt.rn.bf16.f32`); a kernel that rounds to bf16 every layer then drifts far from the
reference (a tiny K3 model's bf16 logits by 60%). `round_bf16_to_nearest_even` below makes the
interpreter round as the GPU does, for every test of this tier. And the interpreter multiplies
bf16 `tl.dot` operands as their raw 16-bit patterns (numpy has no bf16); `dot_bf16_as_float32`
widens them first (exact), as the tensor cores' bf16 products with fp32 accumulation do."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton: the kernel tier)")


from k3.platforms.triton_kernels.interpreter_fidelity import (dot_bf16_as_float32,  # noqa: E402,F401
                                                              round_bf16_to_nearest_even)

round_bf16_to_nearest_even()
dot_bf16_as_float32()
