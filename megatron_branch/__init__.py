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

import importlib
from typing import Any

# Public name -> module. Imported on first use, so that ``import megatron_branch`` (and the
# CLI's ``--help``) do not import megatron-core before they need it.
_EXPORTS = {
    "BranchCoreAttention": "megatron_branch.spec.core_attention",
    "BranchPackedSeqParams": "megatron_branch.spec.packed_seq",
    "BranchSegment": "megatron_branch.tree",
    "BranchSelfAttention": "megatron_branch.spec.self_attention",
    "BranchTree": "megatron_branch.tree",
    "ReplayStats": "megatron_branch.replay",
    "enable_cpu": "megatron_branch.cpu",
    "get_branch_layer_spec": "megatron_branch.spec",
    "is_branch_model": "megatron_branch.spec",
    "packed_logprobs": "megatron_branch.scoring.packed",
    "prefix_grad_bias": "megatron_branch.reference.bias",
    "replay_logprobs": "megatron_branch.replay",
    "replay_step": "megatron_branch.replay",
    "rollout_logprobs": "megatron_branch.scoring.logprobs",
}
_SUBMODULES = {
    "agentic", "attention", "commands", "full_state", "hf", "integrations", "losses", "reference", "replay",
    "scoring", "spec", "training", "tree",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"megatron_branch.{name}")
    else:
        raise AttributeError(f"module 'megatron_branch' has no attribute {name!r}")
    globals()[name] = value
    return value


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
    "packed_logprobs",
    "prefix_grad_bias",
    "replay_logprobs",
    "replay_step",
    "ReplayStats",
    "rollout_logprobs",
]
