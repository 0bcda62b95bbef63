"""k3 conformance suite: checks any platform plugin against the core reference."""
