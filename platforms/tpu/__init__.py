"""k3 platform package for tpu (plugin hooks arrive with the plugins issue)."""
