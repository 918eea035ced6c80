"""Streaming branch replay: a replay plan, the replayer that runs it, and the one ``replay_step``."""

from megatron_branch.replay.plan import ReplayOp, plan_replay
from megatron_branch.replay.step import ReplayStats, collect_routing_statistics, replay_logprobs, replay_step

__all__ = ["ReplayOp", "ReplayStats", "collect_routing_statistics", "plan_replay", "replay_logprobs", "replay_step"]
