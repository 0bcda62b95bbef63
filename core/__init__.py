"""k3: serving stack for Kimi K3-architecture models."""
__version__ = "0.1.0"
