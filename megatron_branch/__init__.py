"""megatron_branch: exact branch replay for RL post-training on Megatron-Core.

Rollouts that share a prompt (and often an early part of the response) are deduplicated
into a prefix tree; every unique token position is computed once, with gradients equal
to running each rollout separately.

    import megatron_branch as mb
    mb.enable_cpu()                        # only on a machine without CUDA
    tree = mb.BranchTree.from_sequences(rollouts)
    model = GPTModel(config, mb.get_branch_layer_spec(normalization="RMSNorm"), ...)
    lp = mb.rollout_logprobs(model, tree)  # [R, max_len - 1], differentiable
    stats = mb.replay_step(model, tree, loss_fn, max_chunk_tokens=4096)  # memory-bounded
"""

from megatron_branch import losses
from megatron_branch.attention.core_attention import BranchCoreAttention
from megatron_branch.cpu import enable_cpu
from megatron_branch.logprobs import rollout_logprobs
from megatron_branch.packed_seq import BranchPackedSeqParams
from megatron_branch.replay import ReplayStats, prefix_grad_bias, replay_logprobs, replay_step
from megatron_branch.self_attention import BranchSelfAttention
from megatron_branch.spec import get_branch_layer_spec, is_branch_model
from megatron_branch.tree import BranchSegment, BranchTree

__version__ = "0.1.0"

__all__ = [
    "BranchCoreAttention",
    "BranchPackedSeqParams",
    "BranchSegment",
    "BranchSelfAttention",
    "BranchTree",
    "enable_cpu",
    "get_branch_layer_spec",
    "is_branch_model",
    "losses",
    "prefix_grad_bias",
    "replay_logprobs",
    "replay_step",
    "ReplayStats",
    "rollout_logprobs",
]
