"""k3.platforms.tpu: the plugin for Google TPUs (torch-xla, in its own torch 2.9 environment).

Entry point `tpu` of the `k3` group -> `k3.platforms.tpu.plugin`; see README.md here.
"""
