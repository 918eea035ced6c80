"""Megatron ``MLASelfAttention`` (multi-latent attention) with RoPE at tree positions.

Multi-latent attention (DeepSeek-V2/V3, Kimi-K2) builds its rotary table inside the
layer, by sequence index, from the length of its input. In a packed tree a token's RoPE
position is its depth, so this subclass runs the stock
``get_query_key_value_tensors`` as on an ordinary ``[s, 1, h]`` sequence while the
layer's rotary module is shadowed, for that call only, by one that returns the stock
table's rows at the tree positions (:class:`_TreeRotary`). Everything else — the down
and up projections, the latent layer norms, the decoupled RoPE part of the key (one
``qk_pos_emb_head_dim`` vector shared by all heads), YaRN's ``mscale`` — is the stock
code, and the core attention slot holds
:class:`~megatron_branch.spec.core_attention.BranchCoreAttention`, which takes query/key
heads of ``qk_head_dim + qk_pos_emb_head_dim`` and value heads of ``v_head_dim``.
Parameters and names are the stock layer's, so checkpoints load unchanged.

Refused (``ValueError`` naming the option) because the stock code path they select
cannot be fed tree positions exactly: ``apply_rope_fusion`` (fused kernels index the
cos/sin cache by sequence offset), ``cache_mla_latents`` (inference absorption),
``experimental_attention_variant`` (DSA's indexer needs its own tree support) and
``qk_clip`` (reads attention logits the tree kernels do not record). Tensor parallelism
is accepted only where megatron-core's own MLA is exact under it (see
:meth:`BranchMLASelfAttention._check_tensor_parallel`); context parallelism splits the
tree as for any attention layer.
"""

from __future__ import annotations

from contextlib import contextmanager

from megatron_branch._megatron import MLASelfAttention, mla_unbuildable_reason
from megatron_branch.spec.packed_seq import BranchPackedSeqParams
from megatron_branch.spec.self_attention import gather_rotary


class _TreeRotary:
    """Stands in for an MLA layer's rotary module for one call: the stock table at the
    tree's positions, ``[n_local, 1, 1, dim]`` (with YaRN's ``mscale``, as the stock
    module returns it)."""

    def __init__(self, stock, params: BranchPackedSeqParams):
        self.stock, self.params = stock, params

    def get_rotary_seq_len(self, *args, **kwargs):
        return self.stock.get_rotary_seq_len(*args, **kwargs)

    def __call__(self, seq_len, offset=0, packed_seq=False, **kwargs):
        params, stock = self.params, self.stock

        def build():
            # The whole table up to the deepest position: packed_seq=True keeps the stock
            # module from slicing it by CP rank (the positions are already this rank's).
            out = stock(params.max_seqlen_q, packed_seq=True)
            if isinstance(out, tuple):  # YaRN: (table, mscale)
                return stock, (gather_rotary(out[0], params.positions), out[1])
            return stock, gather_rotary(out, params.positions)

        # One gather per layer module and forward (kept for the recompute in the backward).
        return params.memo(("mla-rope", id(stock)), build)[1]


class BranchMLASelfAttention(MLASelfAttention):
    """Stock multi-latent self-attention whose rotary embedding follows the tree's depths."""

    def __init__(self, config, *args, **kwargs):
        reason = mla_unbuildable_reason()
        if reason:
            raise ValueError(f"multi_latent_attention: {reason}")
        for option, why in (
            ("apply_rope_fusion", "the fused MLA RoPE kernels index cos/sin by sequence offset"),
            ("cache_mla_latents", "latent caching is an inference path"),
            ("experimental_attention_variant", "attention variants (DSA) have no tree support"),
            ("qk_clip", "QK-clip reads attention logits the tree kernels do not record"),
        ):
            if getattr(config, option, None):
                raise ValueError(f"{option}: not supported by the branch spec's multi-latent attention ({why}); "
                                 f"set it off (got {getattr(config, option)!r})")
        super().__init__(config, *args, **kwargs)
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        # megatron-core's MLA shares one RoPE key vector among all heads; under TP each rank
        # holds some heads, so that vector's gradient must be summed over the TP ranks. The
        # stock code sums it only through the sequence-parallel gather of a duplicated
        # (unsharded) kv down projection: with a column-parallel one (Megatron's local MLA
        # spec) or without sequence parallelism each rank keeps its own heads' share, and
        # stock TP differs from TP=1 (measured on megatron-core 0.19.2, local spec, TP=2:
        # 0.76 relative error in linear_kv_down_proj's RoPE rows, with and without SP).
        tp = self.pg_collection.tp.size() if self.pg_collection.tp is not None else 1
        if tp == 1:
            return
        down = getattr(self, "linear_kv_down_proj", None)
        full = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        duplicated = down is not None and getattr(down, "weight", None) is not None and down.weight.shape[0] == full
        if not (duplicated and self.config.sequence_parallel):
            raise ValueError(
                "tensor_model_parallel_size: megatron-core's multi-latent attention leaves the gradient of the "
                "key's shared RoPE part summed over one rank's heads unless its kv down projection is duplicated "
                "and sequence_parallel is on (here: "
                f"{'duplicated' if duplicated else 'column-parallel or fused'} down projection, "
                f"sequence_parallel={self.config.sequence_parallel}), so it differs from TP=1; use TP=1 (CP "
                "splits trees exactly), or Transformer Engine's MLA spec with sequence_parallel=True"
            )

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, *args, **kwargs):
        if not isinstance(packed_seq_params, BranchPackedSeqParams):
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, packed_seq_params, *args, **kwargs)
        # A tree runs as one [U, 1, h] sequence; only the rotary rows differ from stock.
        with self._tree_rotary(packed_seq_params):
            return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids, None,
                                                       *args, **kwargs)

    @contextmanager
    def _tree_rotary(self, params: BranchPackedSeqParams):
        # An instance attribute shadows the registered submodule of the same name for the
        # duration of the stock call; the module tree (and state dict) never changes.
        self.__dict__["rotary_pos_emb"] = _TreeRotary(self._modules["rotary_pos_emb"], params)
        try:
            yield
        finally:
            del self.__dict__["rotary_pos_emb"]
