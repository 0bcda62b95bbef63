"""Fast paths written with torch itself (no Triton), shared by the GPU plugins: each has the
signature of its k3.reference op, falls back to that op for inputs it does not cover, and runs
on any torch device, so CI checks it on the CPU against the reference."""
