"""k3.platforms.nvidia: the plugin for NVIDIA GPUs (a CUDA build of torch, triton).

Entry point `nvidia` of the `k3` group -> `k3.platforms.nvidia.plugin`; see README.md here.
"""
