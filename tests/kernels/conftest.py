"""Triton kernels on the CPU through Triton's interpreter, at tiny shapes, against the
reference ops. TRITON_INTERPRET must be set before a kernel module is imported (Triton reads
it when a kernel is decorated), so it is set here, at collection.

What the interpreter cannot show, and the GPU conformance run must: races between threads of
one program (the interpreter runs a program's lanes in lockstep, one program at a time), and
bf16 rounding (it truncates fp32 -> bf16; the GPU rounds to nearest even), so rounding-faithful
checks here use fp16."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton: the kernel tier)")
