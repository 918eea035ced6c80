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

Streaming replay keeps each stem's final state and last convolution inputs per layer
in the path cache and injects their accumulated gradients with the stem's backward,
as for attention's K/V. Refused (``ValueError`` naming the layer and option): context
parallelism (the stock layer exchanges heads across CP ranks for a linear sequence; a
tree split has no state exchange yet) and tensor parallelism without sequence
parallelism (the shared ``out_norm`` weight's gradient would be one rank's share).
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
        if self.tp_size > 1 and not config.sequence_parallel:
            # out_norm normalises each head with one weight shared by all heads; under TP a rank
            # sees its heads only, and finalize_model_grads sums norm gradients over TP only for
            # sequence-parallel norms: without SP the weight's gradient is one rank's share
            # (measured, TP=2: 0.52 relative error in out_norm.weight; with SP exact)
            raise ValueError(f"sequence_parallel: layer {self.layer_number} (GatedDeltaNet) under "
                             "tensor_model_parallel_size > 1 needs sequence_parallel=True (megatron-core sums "
                             "its out_norm gradient over TP ranks only then)")

    def forward(self, hidden_states, attention_mask, inference_context=None, packed_seq_params=None,
                sequence_len_offset=None, *, inference_params=None, **kwargs):
        if not isinstance(packed_seq_params, BranchPackedSeqParams):
            return super().forward(hidden_states, attention_mask, inference_context, packed_seq_params,
                                   sequence_len_offset, inference_params=inference_params, **kwargs)
        if inference_context is not None or inference_params is not None:
            raise ValueError(f"inference_context: layer {self.layer_number} (GatedDeltaNet) has no tree inference path")
        return self._tree_forward(hidden_states, packed_seq_params)

    def _check_tree(self, params: BranchPackedSeqParams) -> None:
        if self.cp_size > 1 or params.cp is not None:
            raise ValueError(f"context_parallel_size: layer {self.layer_number} (GatedDeltaNet) has no state "
                             "exchange for a tree split over context-parallel ranks; run hybrid models with "
                             "context_parallel_size=1")

    def _tree_forward(self, hidden_states, params: BranchPackedSeqParams):
        """``hidden_states [U / sp, 1, h]`` of one packed unit -> ``(out [U / sp, 1, h], bias)``.

        In streaming replay the unit continues the path of stems above it: its top
        segments start from the deepest stem's final state and its convolution reads the
        path's last inputs (:class:`~megatron_branch.attention.recurrent_path.RecurrentPath`);
        a stem's forward records both for the units below it.
        """
        self._check_tree(params)
        cache = params.cache
        path = cache.recurrent if cache is not None else None
        # [U, 1, qkvzba] (sequence parallelism gathers the unit's tokens)
        qkvzba, _ = self.in_proj(hidden_states)
        n = qkvzba.shape[0]
        qkvzba = qkvzba.transpose(0, 1)  # [1, U, qkvzba], Megatron's bshd
        qkv, gate, beta, alpha = qkvzba.split(self.feat_dim_split, dim=-1)
        gate = gate.reshape(1, n, -1, self.value_head_dim)
        window = self.conv1d.weight.shape[-1]
        stem = params.stem_id
        x = qkv[0]  # [U, conv_dim] convolution inputs
        if stem is not None and params.inject:
            x = path.inject_rows(x, params.cached_rows, self.layer_number, stem)
        tail = path.tail(self.layer_number, window - 1) if path is not None else None
        initial = path.path_state(self.layer_number) if path is not None else None
        rows = 0 if tail is None else tail.shape[0]
        plan = params.memo(("gdn-plan", window, rows), lambda: TreeRecurrencePlan.build(
            params.segments, n, window, has_path=rows > 0, path_rows=rows, device=qkv.device))
        # conv over each token's path, then the stock activation: [1, U, conv_dim]
        qkv = self.act_fn(tree_causal_conv(x, self.conv1d.weight, self.conv1d.bias, plan, path_tail=tail))[None]
        query, key, value, gate, beta, alpha = self._prepare_input_for_gated_delta_rule(qkv, gate, 1, n, beta, alpha)
        g, beta = self._compute_g_and_beta(self.A_log, self.dt_bias, alpha, beta)
        # [U, H, dv]: each segment's scan from its parent's final state (the path's for the top ones)
        core, finals = tree_scan(query[0], key[0], value[0], g[0], beta[0], plan, self._kernel,
                                 initial_state=initial)
        if stem is not None:
            final = finals[self._stem_segment(params)]
            path.record(self.layer_number, x, params.cached_rows, window, final, stem)
            if params.inject:
                core = path.inject_state(core, final, self.layer_number, stem)
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

    def _stem_segment(self, params: BranchPackedSeqParams) -> int:
        """The segment of a stem's chain (its first segment; complete subtrees run with the
        stem and padding come after it)."""
        real = [i for i, seg in enumerate(params.segments) if seg.start < params.cached_rows]
        if len(real) != 1 or params.segments[real[0]].end != params.cached_rows:
            raise RuntimeError(f"layer {self.layer_number} (GatedDeltaNet): a stem must be one chain, got "
                               f"{len(real)} segments")
        return real[0]

    def _kernel(self, q, k, v, *, g, beta, initial_state, output_final_state):
        return self.gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=False)
