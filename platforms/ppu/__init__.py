"""k3.platforms.ppu: the plugin for Alibaba T-HEAD Zhenwu PPUs (the torch-native path).

Entry point `ppu` of the `k3` group -> `k3.platforms.ppu.plugin`; see README.md here.
"""
