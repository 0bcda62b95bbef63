"""Two corrections that make Triton 3.6's interpreter compute as the GPUs do, for runs that check
kernels on the CPU (tests/kernels, the simulated AMD platform's conformance run):

- its fp32 -> bf16 cast truncates where the GPU rounds to nearest even (`cvt.rn.bf16.f32`, and
  AMD's v_cvt_pk_bf16_f32); a kernel that rounds to bf16 every layer then drifts far from the
  reference (a tiny K3 model's bf16 logits by 60%). `round_bf16_to_nearest_even` makes it round.
- its tl.dot multiplies bf16 operands as their raw 16-bit patterns (numpy has no bf16);
  `dot_bf16_as_float32` widens them first (exact), as the matrix cores' bf16 products with fp32
  accumulation do.

Both patch `triton.runtime.interpreter.InterpreterBuilder` once (idempotent); `apply` does both.
Nothing changes for compiled kernels.
"""


def round_bf16_to_nearest_even() -> None:
    """Patch the interpreter's fp32 -> bf16 cast to round to nearest even, as the GPU does."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter.InterpreterBuilder.cast_impl, "k3_rtne", False):
        return
    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(src.data)
            rounded[nan] = 0x7FC0
            return interpreter.TensorHandle(rounded.reshape(np.shape(src.data)), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl.k3_rtne = True
    interpreter.InterpreterBuilder.cast_impl = cast_impl


def dot_bf16_as_float32() -> None:
    """Patch the interpreter's tl.dot to widen bf16 operands to fp32 before multiplying."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter.InterpreterBuilder.create_dot, "k3_bf16", False):
        return
    original = interpreter.InterpreterBuilder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = np.ascontiguousarray(handle.data).view(np.uint16).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot.k3_bf16 = True
    interpreter.InterpreterBuilder.create_dot = create_dot


def apply() -> None:
    """Both corrections (idempotent)."""
    round_bf16_to_nearest_even()
    dot_bf16_as_float32()
