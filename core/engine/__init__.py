"""Generation: the single-request reference loop (and, with the serving issue, the engine)."""
