"""Megatron ``GatedDeltaNet`` over a packed tree: each branch continues its parent's state.

A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) mixes the sequence with a causal
convolution and a gated delta-rule recurrence, not attention; a branch inherits the
parent's convolution window and recurrent state at the branch point. With tree data
(:class:`~megatron_branch.spec.packed_seq.BranchPackedSeqParams`) this subclass runs the
stock layer's own pieces — ``in_proj``, the split, the activation, Megatron's
``_prepare_input_for_gated_delta_rule`` (L2 norm, head repeat) and ``_compute_g_and_beta``,
the layer's delta-rule kernel, the gated ``out_norm``, ``out_proj`` — with the two
sequence steps replaced by their tree versions
(:mod:`megatron_branch.attention.tree_recurrence`). Without tree data it is the stock
layer. Parameters and names are the stock layer's.

Refused (``ValueError`` naming the layer and option): context parallelism (the stock
layer exchanges heads across CP ranks for a linear sequence; a tree split has no state
exchange yet) and streaming replay with a path above the unit (the path's states are not
kept by the prefix cache yet).
"""

from __future__ import annotations

from megatron_branch._megatron import GatedDeltaNet, MegatronModule, gdn_unavailable_reason, tensor_parallel
from megatron_branch.attention.tree_recurrence import TreeRecurrencePlan, tree_causal_conv, tree_scan
from megatron_branch.spec.packed_seq import BranchPackedSeqParams


class _NoGatedDeltaNet(MegatronModule):
    """Stands in for the base class where megatron-core has no ``GatedDeltaNet`` (0.16)."""


class BranchGatedDeltaNet(GatedDeltaNet if GatedDeltaNet is not None else _NoGatedDeltaNet):
    """Stock Gated DeltaNet whose convolution and recurrence follow the tree."""

    def __init__(self, config, *args, **kwargs):
        reason = gdn_unavailable_reason()
        if reason:
            raise ValueError(f"experimental_attention_variant: {reason}")
        super().__init__(config, *args, **kwargs)

    def forward(self, hidden_states, attention_mask, inference_context=None, packed_seq_params=None,
                sequence_len_offset=None, *, inference_params=None, **kwargs):
        if not isinstance(packed_seq_params, BranchPackedSeqParams):
            return super().forward(hidden_states, attention_mask, inference_context, packed_seq_params,
                                   sequence_len_offset, inference_params=inference_params, **kwargs)
        if inference_context is not None or inference_params is not None:
            raise ValueError(f"inference_context: layer {self.layer_number} (GatedDeltaNet) has no tree inference path")
        return self._tree_forward(hidden_states, packed_seq_params)

    def _check_tree(self, params: BranchPackedSeqParams) -> None:
        where = f"layer {self.layer_number} (GatedDeltaNet)"
        if self.cp_size > 1 or params.cp is not None:
            raise ValueError(f"context_parallel_size: {where} has no state exchange for a tree split over "
                             "context-parallel ranks; run hybrid models with context_parallel_size=1")
        if params.stem_id is not None or (params.cache is not None and params.cache.has_path):
            raise ValueError(f"max_chunk_tokens: {where} cannot stream yet (the prefix cache keeps no "
                             "recurrent states); replay hybrid models in one pass (max_chunk_tokens=None)")

    def _tree_forward(self, hidden_states, params: BranchPackedSeqParams):
        """``hidden_states [U / sp, 1, h]`` of one packed unit -> ``(out [U / sp, 1, h], bias)``."""
        self._check_tree(params)
        # [U, 1, qkvzba] (sequence parallelism gathers the unit's tokens)
        qkvzba, _ = self.in_proj(hidden_states)
        n = qkvzba.shape[0]
        qkvzba = qkvzba.transpose(0, 1)  # [1, U, qkvzba], Megatron's bshd
        qkv, gate, beta, alpha = qkvzba.split(self.feat_dim_split, dim=-1)
        gate = gate.reshape(1, n, -1, self.value_head_dim)
        window = self.conv1d.weight.shape[-1]
        plan = params.memo(("gdn-plan", window), lambda: TreeRecurrencePlan.build(
            params.segments, n, window, has_path=False, device=qkv.device))
        # conv over each token's path, then the stock activation: [1, U, conv_dim]
        qkv = self.act_fn(tree_causal_conv(qkv[0], self.conv1d.weight, self.conv1d.bias, plan))[None]
        query, key, value, gate, beta, alpha = self._prepare_input_for_gated_delta_rule(qkv, gate, 1, n, beta, alpha)
        g, beta = self._compute_g_and_beta(self.A_log, self.dt_bias, alpha, beta)
        # [U, H, dv]: each segment's scan from its parent's final state
        core, _ = tree_scan(query[0], key[0], value[0], g[0], beta[0], plan, self._kernel)
        core = core[None]
        if self.recompute_norm_out:
            self.norm_out_checkpoint = tensor_parallel.CheckpointWithoutOutput()
            norm_out = self.norm_out_checkpoint.checkpoint(
                lambda c, gt: self._gated_norm_and_a2a(c, gt, None, 1, n, None), core, gate)
        else:
            norm_out = self._gated_norm_and_a2a(core, gate, None, 1, n, None)
        out, out_bias = self.out_proj(norm_out)
        if self.recompute_norm_out:
            self.norm_out_checkpoint.discard_output_and_register_recompute(out)
        return out, out_bias

    def _kernel(self, q, k, v, *, g, beta, initial_state, output_final_state):
        return self.gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=False)
