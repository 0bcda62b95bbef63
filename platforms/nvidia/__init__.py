"""k3 platform package for nvidia (plugin hooks arrive with the plugins issue)."""
