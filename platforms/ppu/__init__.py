"""k3 platform package for ppu (plugin hooks arrive with the plugins issue)."""
