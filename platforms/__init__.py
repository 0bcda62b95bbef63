"""Vendor platform plugins for k3, found through the `k3` entry-point group."""
