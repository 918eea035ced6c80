"""Megatron ``SelfAttention`` with RoPE at tree positions.

Megatron's GPTModel builds its rotary table by *sequence index* and ignores
``position_ids``. In a packed tree a token's RoPE position is its depth, so this
subclass gathers the rows of that table by the tree positions carried in
:class:`~megatron_branch.spec.packed_seq.BranchPackedSeqParams` before calling the stock
forward. Parameters, names and everything else are the stock ``SelfAttention``'s, so
checkpoints load unchanged in both directions.
"""

from __future__ import annotations

from megatron_branch._megatron import SelfAttention
from megatron_branch.spec.packed_seq import BranchPackedSeqParams


def gather_rotary(rotary_pos_emb, positions):
    """Rows of a ``[L, 1, 1, dim]`` rotary table (or a (q, k) pair) at ``positions [U]``."""
    if rotary_pos_emb is None:
        return None
    if isinstance(rotary_pos_emb, tuple):
        return tuple(gather_rotary(t, positions) for t in rotary_pos_emb)
    # [L, 1, 1, dim] -> [U, 1, 1, dim]
    return rotary_pos_emb.index_select(0, positions.to(rotary_pos_emb.device))


class BranchSelfAttention(SelfAttention):
    """Stock self-attention whose rotary embedding follows the tree's depths."""

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        params = kwargs.get("packed_seq_params")
        table = kwargs.get("rotary_pos_emb")
        if isinstance(params, BranchPackedSeqParams) and table is not None:
            # Every layer gets the same table: gather once per forward (the entry keeps the
            # table alive, so its id cannot be reused by another table).
            key = ("rope", id(table[0] if isinstance(table, tuple) else table))
            kwargs["rotary_pos_emb"] = params.memo(key, lambda: (table, gather_rotary(table, params.positions)))[1]
        return super().forward(hidden_states, attention_mask, *args, **kwargs)
