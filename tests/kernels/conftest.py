"""Triton kernels on the CPU through Triton's interpreter, at tiny shapes, against the
reference ops. TRITON_INTERPRET must be set before a kernel module is imported (Triton reads
it when a kernel is decorated), so it is set here, at collection."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton: the kernel tier)")
