"""Tree attention kernels: the cascade (default) and dense backends.

The Megatron module that uses them is
:class:`megatron_branch.spec.core_attention.BranchCoreAttention`.
"""

from megatron_branch.attention.cascade import AttentionPiece, cascade_attention, plan_pieces
from megatron_branch.attention.dense import dense_tree_attention, visibility_mask

__all__ = [
    "AttentionPiece",
    "cascade_attention",
    "dense_tree_attention",
    "plan_pieces",
    "visibility_mask",
]
