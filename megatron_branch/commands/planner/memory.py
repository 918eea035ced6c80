"""What one streaming branch-replay step keeps in memory, rank by rank.

This follows the implementation, not a rule of thumb: it walks the same replay plan
(:func:`megatron_branch.replay.plan.plan_replay`), splits every unit over the CP ranks
with the same work-balanced bounds (:func:`megatron_branch.attention.context_parallel.shard_bounds`)
and counts, per rank:

* the path cache (:class:`megatron_branch.attention.path_cache.PathCache`): allocated once for the
  deepest stem path — this rank's rows x layers x (K width + V width) at the activation
  width, plus float32 gradient accumulators of the same shape in exact replay
  (:func:`kv_widths`: ``kv_heads x head_dim`` each, or multi-latent attention's
  uncompressed per-head K and V);
* the unit being run (a chunk, or a stem recomputed for its backward): saved activations
  ``LAYER_ELEMS`` per token per layer, ``TOKEN_ELEMS`` per token outside the layers, the
  unit's K/V gathered over CP and saved by every layer's attention, and float32 logits for
  the scored tokens only, one row each at its parent (``LOGIT_COPIES`` x vocab: Megatron's
  cross-entropy works in place on the model's logits and its gradient reuses them), with
  the output layer's weight-gradient temporaries (``OUTPUT_GRAD_COPIES`` x vocab x hidden)
  that meet them at its backward;
* the log-probs of the stems' children (a float32 leaf of ``U`` entries and its gradient);
* the attention backward's float32 working set, which meets the other layers' saved
  activations at the top layer's backward (when the logits are already freed, so the
  larger of the two counts): ``ATTN_PIECES`` x queries x hidden for the unit's own pieces,
  and for the path cache ``ATTN_PREFIX`` x prefix queries x hidden plus ``ATTN_CACHE`` x
  cached rows x kv_dim (``dK``/``dV`` and their kernel outputs; ``kv_dim`` is the mean of
  the K and V widths, ``hidden`` the heads' mean query/value width). Under CP every rank runs
  the prefix attention for *all* the unit's queries (all-gathered) against its own rows,
  and keeps the gathered ``q``, ``dO``, ``O`` and a reduce buffer (``ATTN_CP`` x unit
  queries x hidden) plus the unit's gathered ``dK``/``dV``.

Hybrid Gated DeltaNet models (Qwen3-Next, Qwen3.5) differ layer by layer: only the attention
layers hold K/V in the path cache. A Gated DeltaNet layer instead keeps, per stem on the
path (:class:`megatron_branch.attention.recurrent_path.RecurrentPath`), the stem's final
recurrent state (``linear_num_value_heads x d_k x d_v``, float32) and its last
``linear_conv_kernel_dim - 1`` convolution inputs (``conv_dim`` wide, activation dtype),
plus float32 gradient accumulators of both in exact replay — whatever the stem's length
(:func:`recurrent_state_bytes`); its saved activations per token follow its projection
widths (:func:`gdn_layer_elems`, counted, not fitted). Context parallelism is refused for
these layers by the package (no state exchange), so the CP terms never meet them.

The path's K/V are never gathered (the prefix attention runs where the keys live), so
nothing else grows with the prompt. ``megatron-branch plan`` uses exactly this function
(:func:`replay_peak_parts`, on the workload's tree, :func:`workload_tree`), and so does
``megatron-branch bench-scale``, which checks it against measured peaks. The constants are fitted on single-process fp32 runs
of Megatron's local layers (:func:`megatron_branch.commands.planner.validate.validate_on_cpu` and
``tests/test_planner.py``); ``megatron-branch bench-scale`` checks them, rank by rank,
on context-parallel runs they were not fitted on.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megatron_branch.attention.context_parallel import shard_bounds
from megatron_branch.flops import ModelShape
from megatron_branch.replay.plan import plan_replay
from megatron_branch.scoring.output_rows import scored_tokens
from megatron_branch.scoring.unit import shape_linear_weight
from megatron_branch.tree import BranchTree

# saved activation elements per token per layer: a_h * hidden + a_kv * kv_dim + a_ffn * ffn
LAYER_ELEMS = (10.2, 3.1, 5.1)
TOKEN_ELEMS = 2.0  # x hidden, per token outside the layers (embedding output, final norm)
LOGIT_COPIES = 1.0  # x vocab x 4 B, per scored token (its logits row)
# x vocab x hidden x 4 B at the output layer's backward, with the logits: its weight-gradient
# GEMM output and transpose, and the output and embedding weights' gradients, which the CPU
# measurement the constants are fitted on counts once they are accumulated into (so a GPU
# plan, which lists gradients apart, counts those two twice: on the safe side)
OUTPUT_GRAD_COPIES = 4.0
ATTN_PIECES = 12.5  # float32 x local queries x hidden: the pieces' backward
ATTN_PREFIX = 4.5  # float32 x prefix queries x hidden: the path piece's backward
ATTN_CACHE = 6.0  # float32 x cached rows x kv_dim: its dK/dV
ATTN_CP = 4.0  # float32 x unit queries x hidden: gathered q, dO, O and the reduce buffer
# saved activation elements per token of a Gated DeltaNet mixer, x its in_proj width: counted
# from what autograd keeps (in_proj's output, the convolution's output and its activation, the
# L2-normed q/k repeated to the value heads, the core output, the gated norm's pieces: about
# 4.3x for Qwen3-Next), not fitted -- megatron-core < 0.19 has no GatedDeltaNet to measure
GDN_PROJ = 4.0


def kv_widths(spec, tp: int = 1) -> Tuple[int, int]:
    """Elements of K and of V that branch replay keeps per token per layer on one TP rank.

    Grouped-query attention: ``kv_heads x head_dim`` each. Multi-latent attention
    (DeepSeek-V2/V3): the uncompressed post-RoPE K and V the attention runs on, not the
    ``kv_lora_rank`` latent: K is ``num_attention_heads x (qk_head_dim + qk_pos_emb_head_dim)``
    (the shared RoPE part repeated in every head), V is ``num_attention_heads x v_head_dim``.
    """
    heads = max(spec.num_kv_heads // tp, 1)
    return heads * spec.key_channels, heads * spec.value_channels


def _kv_dim(spec, tp: int) -> float:
    """The mean of the K and V widths: what the fitted constants multiply (fitted with K = V)."""
    k, v = kv_widths(spec, tp)
    return (k + v) / 2


def _attn_width(spec, tp: int) -> float:
    """This rank's heads x their mean query/value width (``heads x head_dim`` with K = V)."""
    return spec.num_attention_heads // tp * (spec.key_channels + spec.value_channels) / 2


def layer_elems(spec, tp: int = 1) -> float:
    a_h, a_kv, a_f = LAYER_ELEMS
    kv_dim = _kv_dim(spec, tp)
    return (a_h * spec.hidden_size) / tp + a_kv * kv_dim + a_f * spec.ffn_hidden_size / tp


def gdn_layer_elems(spec, tp: int = 1) -> float:
    """Saved activation elements per token of one Gated DeltaNet layer on one TP rank: the
    fitted hidden-width and MLP terms of :data:`LAYER_ELEMS` (norms, residuals, the MLP) and
    ``GDN_PROJ x`` the mixer's ``in_proj`` width (``2 qk_dim + 2 v_dim + 2 value heads``) in
    place of the attention's K/V term. Under TP each rank holds its heads' share (sequence
    parallelism, which the package requires for these layers, splits the hidden-width terms)."""
    a_h, _, a_f = LAYER_ELEMS
    return (a_h * spec.hidden_size) / tp + GDN_PROJ * spec.gdn_in_proj_dim / tp + a_f * spec.ffn_hidden_size / tp


def recurrent_state_bytes(spec, stems: int, *, tp: int = 1, layers: int, act_bytes: int, exact: bool = True) -> float:
    """What ``layers`` Gated DeltaNet layers keep for ``stems`` stems on the path (bytes, one TP
    rank), independent of the stems' lengths: per stem and layer the final recurrent state
    ``linear_num_value_heads x d_k x d_v`` in float32 (the kernels' state dtype) and the last
    ``linear_conv_kernel_dim - 1`` convolution inputs of ``conv_dim = 2 qk_dim + v_dim``
    channels at the activation width; exact replay adds float32 gradient accumulators of both.
    TP splits the heads and the channels."""
    heads = spec.linear_num_value_heads // tp
    state = heads * spec.linear_key_head_dim * spec.linear_value_head_dim * 4 * (2 if exact else 1)
    tail = (spec.linear_conv_kernel_dim - 1) * (spec.gdn_conv_dim // tp) * (act_bytes + (4 if exact else 0))
    return float(stems * layers * (state + tail))


def unit_parts(spec, tokens: float, unit_tokens: float, scored_rows: float, *, tp: int, cp: int, layers: int,
               act_bytes: int, cached_rows: float = 0, has_path: bool = False, recompute: str = "none",
               gdn_layers: int = 0) -> dict:
    """Working set of one unit on one rank at its backward, by part (bytes).

    Args:
        tokens: this rank's tokens of the unit; unit_tokens: the whole unit's.
        scored_rows: this rank's logits rows (one per scored token, at its parent).
        cached_rows: this rank's rows of the path cache above the unit.
        has_path: stems are cached above the unit (it runs the path attention).
        recompute: Megatron's activation recompute (``"full"`` keeps each layer's input
            and one layer's activations).
        gdn_layers: how many of the ``layers`` are Gated DeltaNet (no K/V, no attention
            workspace; :func:`gdn_layer_elems` activations).
    """
    kv_dim = _kv_dim(spec, tp)
    hidden = _attn_width(spec, tp)
    attn_layers = layers - gdn_layers
    if recompute == "full":
        one = layer_elems(spec, tp) if attn_layers else 0.0
        if gdn_layers:
            one = max(one, gdn_layer_elems(spec, tp))
        per_token = layers * spec.hidden_size / tp + one
    else:
        per_token = attn_layers * layer_elems(spec, tp) + (gdn_layers * gdn_layer_elems(spec, tp) if gdn_layers else 0)
    attention = ATTN_PIECES * tokens * hidden + (2 * unit_tokens * kv_dim if cp > 1 else 0)
    if has_path:
        queries = unit_tokens if cp > 1 else tokens
        attention += ATTN_PREFIX * queries * hidden + ATTN_CACHE * cached_rows * kv_dim
        if cp > 1:
            attention += ATTN_CP * unit_tokens * hidden
    if not attn_layers:
        attention = 0.0
    return {
        "activations": tokens * (per_token + TOKEN_ELEMS * spec.hidden_size / tp) * act_bytes,
        "gathered_kv": attn_layers * 2 * unit_tokens * kv_dim * act_bytes if cp > 1 else 0.0,
        "logits": (scored_rows * LOGIT_COPIES + (OUTPUT_GRAD_COPIES * spec.hidden_size if scored_rows else 0))
        * spec.vocab_size / tp * 4,
        "attention": 4 * attention,
    }


def unit_bytes(spec, tokens: float, unit_tokens: float, scored_rows: float, **kwargs) -> float:
    """Total of :func:`unit_parts`: the logits and the attention workspace never meet (the
    logits are freed before the layers' backward), so the larger of the two counts."""
    p = unit_parts(spec, tokens, unit_tokens, scored_rows, **kwargs)
    return p["activations"] + p["gathered_kv"] + max(p["logits"], p["attention"])


def cache_bytes(spec, rows: int, *, tp: int, layers: int, act_bytes: int, exact: bool = True) -> float:
    """The path cache of ``rows`` (this rank's share of the deepest stem path): K and V of
    every layer (:func:`kv_widths`), plus float32 gradient accumulators in exact replay."""
    k, v = kv_widths(spec, tp)
    return rows * layers * (k + v) * (act_bytes + (4 if exact else 0))


def replay_peak_parts(spec, tree, *, chunk_tokens: Optional[int], tp: int = 1, cp: int = 1, pp: int = 1,
                      score_mask=None, act_bytes: int = 2, exact: bool = True,
                      recompute: str = "none") -> List[Dict[str, float]]:
    """Peak bytes of one streaming exact replay step (``recompute_stem=True``) per CP rank,
    above the weights, gradients and optimizer state, by part: ``stem_kv_cache`` (values
    and float32 gradient accumulators), for a hybrid model ``stem_gdn_state``
    (:func:`recurrent_state_bytes` for the most stems on the path at once),
    ``unit_activations`` (saved activations and gathered K/V of the unit at its peak),
    ``logits_or_attention`` (the larger of the two), ``logprob_leaves``. With ``pp > 1`` a
    hybrid model's stages differ in their mix of layers: the stage needing the most counts.

    Args:
        spec: a :class:`~megatron_branch.commands.planner.presets.ModelSpec`.
        tree: the packed rollouts (a :class:`~megatron_branch.tree.BranchTree`).
        chunk_tokens: the replay budget (``None``: one pass).
        tp, cp, pp: the layout (sequence parallel with ``tp > 1``).
        score_mask: ``[R, max_len - 1]`` scored positions (``None``: all).
        act_bytes: bytes per activation element (4 fp32, 2 bf16).
        exact: exact replay keeps float32 gradient accumulators for the cache.
        recompute: Megatron's activation recompute (``"none"`` or ``"full"``).
    """
    if spec.is_hybrid and cp > 1:
        raise ValueError(f"cp: {spec.name} has Gated DeltaNet layers, which the package refuses under context "
                         "parallelism (no state exchange for a tree split over CP ranks)")
    layers = -(-spec.num_layers // pp)
    ops = plan_replay(tree, chunk_tokens)
    scored = scored_tokens(tree, score_mask) if score_mask is not None else torch.ones(tree.unique_positions,
                                                                                          dtype=torch.bool)
    parents = tree.parents.clone()
    # logits rows per position: one per scored child (a branch point's row once per child)
    parent_scored = torch.bincount(parents[(parents >= 0) & scored], minlength=tree.unique_positions)
    multiple = tp if tp > 1 else 1
    weight = shape_linear_weight(ModelShape(spec.num_layers, spec.hidden_size, spec.num_attention_heads,
                                            spec.num_kv_heads, spec.ffn_hidden_size, spec.vocab_size))
    # the path cache holds, per rank, that rank's share of the deepest stem path
    stem_rows = [0.0] * cp
    depth_rows = [0.0] * cp
    stack: List[List[int]] = []
    most_stems = 0  # stems on the path at once: each keeps its recurrent state per GDN layer
    units = []  # per unit and rank: (tokens, unit tokens, scored rows, cached rows, has path)
    for op in ops:
        if op.kind == "pop":
            for r, n in enumerate(stack.pop()):
                depth_rows[r] -= n
            continue
        n = op.end - op.start
        total = max(n, cp * multiple)
        total = -(-total // multiple) * multiple
        positions = torch.cat([tree.positions[op.start:op.end], torch.arange(total - n)])
        bounds = shard_bounds(positions, cp, weight, multiple) if cp > 1 else [(0, total)]
        rows = [max(0, min(hi, n) - lo) for lo, hi in bounds]
        scored_rows = [int(parent_scored[op.start + lo:op.start + min(hi, n)].sum()) if hi > lo else 0
                       for lo, hi in bounds]
        units.append([(hi - lo, total, scored_rows[r], int(depth_rows[r]), bool(stack))
                      for r, (lo, hi) in enumerate(bounds)])
        if op.kind == "stem":
            stack.append(rows)
            most_stems = max(most_stems, len(stack))
            for r in range(cp):
                depth_rows[r] += rows[r]
                stem_rows[r] = max(stem_rows[r], depth_rows[r])
    known = tree.unique_positions * 4 * (2 if exact else 1) if stem_rows[0] else 0

    def stage(attn_layers: int, gdn_layers: int) -> List[Dict[str, float]]:
        """Every rank's parts for a stage of ``attn_layers`` attention and ``gdn_layers`` GDN layers."""
        stage_layers = attn_layers + gdn_layers
        peak: List[Dict[str, float]] = [{"unit_activations": 0.0, "logits_or_attention": 0.0} for _ in range(cp)]
        for unit in units:
            for r, (tokens, total, scored, cached, has_path) in enumerate(unit):
                p = unit_parts(spec, tokens, total, scored, tp=tp, cp=cp, layers=stage_layers, act_bytes=act_bytes,
                               cached_rows=cached, has_path=has_path, recompute=recompute, gdn_layers=gdn_layers)
                parts = {"unit_activations": p["activations"] + p["gathered_kv"],
                         "logits_or_attention": max(p["logits"], p["attention"])}
                if sum(parts.values()) > sum(peak[r].values()):
                    peak[r] = parts
        out = []
        for r in range(cp):
            parts = {"stem_kv_cache": cache_bytes(spec, stem_rows[r], tp=tp, layers=attn_layers, act_bytes=act_bytes,
                                                  exact=exact)}
            if spec.is_hybrid:
                parts["stem_gdn_state"] = recurrent_state_bytes(spec, most_stems, tp=tp, layers=gdn_layers,
                                                                      act_bytes=act_bytes, exact=exact)
            out.append({**parts, **peak[r], "logprob_leaves": float(known)})
        return out

    if not spec.is_hybrid:
        return stage(layers, 0)
    stages = [stage(a, g) for a, g in sorted(set(spec.stage_mixers(pp)))]
    return max(stages, key=lambda ranks: max(sum(parts.values()) for parts in ranks))


def replay_peak_bytes(spec, tree, **kwargs) -> List[float]:
    """Total of :func:`replay_peak_parts` per CP rank (what ``megatron-branch bench-scale``
    compares with the measured peaks, rank by rank)."""
    return [sum(parts.values()) for parts in replay_peak_parts(spec, tree, **kwargs)]


def workload_tree(prompt_len: int, rollouts: int, response_len: int, num_prompts: int = 1):
    """The packed tree of a planner workload: ``num_prompts`` prompts of ``prompt_len``
    tokens, each with ``rollouts`` distinct answers of ``response_len`` (one level of
    sharing). The token ids are arbitrary; the plan and the memory depend on the shape."""
    seqs = []
    for p in range(num_prompts):
        prompt = torch.full((prompt_len,), 2 * p, dtype=torch.long)
        for r in range(rollouts):
            answer = torch.full((response_len,), 2 * p + 1, dtype=torch.long)
            answer[0] = 2 * num_prompts + r  # answers differ from their first token
            seqs.append(torch.cat([prompt, answer]))
    return BranchTree.from_sequences(seqs)
