"""MoE under branch replay (being split)."""

from megatron_branch.spec.moe.layer import *  # noqa: F401,F403
from megatron_branch.spec.moe.layer import replay_step  # noqa: F401
