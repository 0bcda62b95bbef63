"""k3 platform package for amd (plugin hooks arrive with the plugins issue)."""
