"""Speculative decoding: proposers (n-gram, draft model, DSpark-style), exact verification,
KDA state rollback. See docs/speculative.md."""
