"""Benchmarks: ``megatron-branch bench``."""
