"""Capacity planner: ``megatron-branch plan``."""
