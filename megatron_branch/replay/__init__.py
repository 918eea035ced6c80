"""Streaming branch replay: prefix-activation cache, chunked branches, exact stem backward."""

from megatron_branch.replay.plan import ReplayOp, plan_replay
from megatron_branch.replay.step import ReplayStats, prefix_grad_bias, replay_logprobs, replay_step

__all__ = ["ReplayOp", "ReplayStats", "plan_replay", "prefix_grad_bias", "replay_logprobs", "replay_step"]
