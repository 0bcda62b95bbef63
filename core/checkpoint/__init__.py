"""Checkpoints: HF-style safetensors directories (load, random init, write)."""
