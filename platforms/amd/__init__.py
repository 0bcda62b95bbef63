"""k3.platforms.amd: the plugin for AMD Instinct GPUs (a ROCm build of torch).

Entry point `amd` of the `k3` group -> `k3.platforms.amd.plugin`; see README.md here.
"""
