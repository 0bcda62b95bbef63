"""Engines the engine tests build on tiny checkpoints."""

from k3.engine.engine import EngineConfig, LLMEngine


def tiny_engine(ckpt, **kw) -> LLMEngine:
    """A float64 engine (token equality, DESIGN.md "Testing equality") with a small CPU cache."""
    kw.setdefault("kv_cache_memory_gib", 0.02)
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="float64", load_progress=False, **kw))
