"""Memory, FLOPs and step time of one streaming branch-replay step on a parallel layout.

Memory per GPU (bytes):

* weights 2 B/param (bf16), main gradients 4 B/param (fp32), optimizer 12 B/param (fp32
  master + Adam moments) sharded over DP x CP (distributed optimizer); parameters split
  over TP x PP; FP8 adds 1 B/param of cached FP8 weights; a Mixture of Experts' routed
  experts are split over EP instead of TP (expert TP = 1) and their optimizer state over
  the expert-data-parallel ranks ``TP x CP x DP / EP``; activations and FLOPs follow the
  *active* parameters (router + top-k experts); the all-to-all time is not modelled;
* parameters of the busiest pipeline stage: its layers, plus the word embedding on the
  first stage and the output layer (untied, or the tied copy under PP) on the last;
* what streaming exact replay keeps on the busiest CP rank
  (:func:`megatron_branch.commands.planner.memory.replay_peak_parts` on the workload's
  tree: the very function ``megatron-branch bench-scale`` checks rank by rank against
  measured peaks): the path cache (this rank's share of the prompt's
  K/V plus float32 gradient accumulators), one unit's saved activations and gathered
  K/V, the larger of its logits and its attention backward's workspace, and the stems'
  log-prob leaves.

Time = FLOPs / (GPUs x peak x MFU), linear GEMMs at the FP8 peak when FP8 is on,
attention (and a Gated DeltaNet layer's recurrence) at the bf16 peak; recompute adds the
recomputed forwards. PP with a single tree per step leaves stages idle, so only
TP x CP x DP GPUs count.

Hybrid Gated DeltaNet models (Qwen3-Next, Qwen3.5): attention FLOPs and the path's K/V
count only the attention layers; a Gated DeltaNet layer costs its projections (in the
linear FLOPs, like any weight) plus a state update linear in the sequence length
(:func:`step_flops`), and keeps a recurrent state per stem instead of K/V.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict

from megatron_branch.commands.planner.memory import replay_peak_parts, workload_tree
from megatron_branch.commands.planner.presets import GPUSpec, ModelSpec

GB = 1e9


@dataclass(frozen=True)
class Workload:
    """``num_prompts`` prompts of ``prompt_len`` tokens, each with ``rollouts`` answers of
    ``response_len`` tokens (one level of sharing: the prompt)."""

    prompt_len: int
    rollouts: int
    response_len: int
    num_prompts: int = 1

    def __post_init__(self):
        for name in ("prompt_len", "rollouts", "response_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")

    @property
    def naive_positions(self) -> int:
        return self.num_prompts * self.rollouts * (self.prompt_len + self.response_len)

    @property
    def unique_positions(self) -> int:
        return self.num_prompts * (self.prompt_len + self.rollouts * self.response_len)

    @property
    def stem_tokens(self) -> int:
        return self.prompt_len

    def attention_pairs(self, tree: bool = True) -> float:
        p, r, g = self.prompt_len, self.response_len, self.rollouts
        if tree:
            per = p * (p + 1) / 2 + g * (r * p + r * (r + 1) / 2)
        else:
            per = g * (p + r) * (p + r + 1) / 2
        return self.num_prompts * per


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    pp: int
    dp: int
    chunk_tokens: int
    recompute: str  # "none" | "full"
    fp8: bool
    ep: int = 1  # expert parallelism (MoE), carved out of TP x CP x DP


def stage_params(model: ModelSpec, lay: Layout) -> Dict[str, float]:
    """Parameters one GPU holds, for the pipeline stage that holds the most: its layers'
    dense parameters split over TP and their routed experts split over EP, plus, on the
    first stage, the word embedding and, on the last, the output layer (a separate matrix
    when untied; Megatron's copy of the embedding when tied and ``PP > 1``) and the final
    norm. With ``PP = 1`` one stage holds all of them.

    Returns:
        ``{"dense", "experts", "total"}`` parameters per GPU.
    """
    layers = -(-model.num_layers // lay.pp)
    embedding = model.vocab_size * model.hidden_size
    output = embedding if (not model.tied_embeddings or lay.pp > 1) else 0
    if model.first_dense_layers or model.is_hybrid:  # stages differ in their layers: take the one holding the most
        return max((_stage(model, lay, s, layers, embedding, output) for s in range(lay.pp)),
                   key=lambda part: part["total"])
    if lay.pp == 1:
        extra = embedding + output + model.hidden_size
    else:  # the first stage (embedding) or the last (output layer and final norm), the larger
        extra = max(embedding, output + model.hidden_size)
    dense = (layers * model.dense_params_per_layer() + extra) / lay.tp
    experts = layers * model.expert_params_per_layer() / lay.ep
    return {"dense": dense, "experts": experts, "total": dense + experts}


def _stage(model: ModelSpec, lay: Layout, stage: int, layers: int, embedding: int, output: int) -> Dict[str, float]:
    """:func:`stage_params` of pipeline stage ``stage`` (``layers`` layers each)."""
    parts = [model.layer_params(i) for i in range(stage * layers, min((stage + 1) * layers, model.num_layers))]
    extra = (embedding if stage == 0 else 0) + (output + model.hidden_size if stage == lay.pp - 1 else 0)
    dense = (sum(d for d, _ in parts) + extra) / lay.tp
    experts = sum(e for _, e in parts) / lay.ep
    return {"dense": dense, "experts": experts, "total": dense + experts}


@functools.lru_cache(maxsize=8)
def _tree(work: Workload):
    return workload_tree(work.prompt_len, work.rollouts, work.response_len, work.num_prompts)


@functools.lru_cache(maxsize=4096)
def replay_memory(model: ModelSpec, work: Workload, chunk_tokens: int, tp: int, cp: int, pp: int, recompute: str,
                  act_bytes: int) -> Dict[str, float]:
    """What the replay keeps on the busiest CP rank (bytes by part):
    :func:`megatron_branch.commands.planner.memory.replay_peak_parts` on the workload's
    tree, the function ``megatron-branch bench-scale`` checks against measured peaks."""
    ranks = replay_peak_parts(model, _tree(work), chunk_tokens=chunk_tokens, tp=tp, cp=cp, pp=pp,
                              act_bytes=act_bytes, recompute=recompute)
    return max(ranks, key=lambda parts: sum(parts.values()))


def memory_per_gpu(model: ModelSpec, work: Workload, lay: Layout, act_bytes: int = 2) -> Dict[str, float]:
    """Bytes per GPU by component (the largest pipeline stage, the busiest CP rank):
    parameters, gradients and optimizer state (:func:`stage_params`), plus what the replay
    keeps (:func:`replay_memory`)."""
    params = stage_params(model, lay)
    replay = replay_memory(model, work, lay.chunk_tokens, lay.tp, lay.cp, lay.pp, lay.recompute, act_bytes)
    return {
        "weights": params["total"] * (2 + (1 if lay.fp8 else 0)),
        "grads": params["total"] * 4,
        "optimizer": params["dense"] * 12 / (lay.dp * lay.cp) + params["experts"] * 12 * lay.ep / (lay.tp * lay.cp * lay.dp),
        **replay,
    }


GDN_STATE_FLOPS = 8  # x heads x d_k x d_v per token, forward: the delta-rule state update


def step_flops(model: ModelSpec, positions: float, pairs: float) -> Dict[str, float]:
    """Forward+backward FLOPs: linear (incl. output layer), attention (``Q K^T`` over the
    query/key width, ``P V`` over the value width; the attention layers only) and, for
    hybrid models, the Gated DeltaNet recurrence.

    The recurrence is modelled simply, as linear in the sequence length and not quadratic:
    per token and GDN layer the forward runs about four ``d_k x d_v`` products per value head
    (decay and read the state with the key, write the delta ``k (v - S^T k)^T``, read it with
    the query), ``GDN_STATE_FLOPS = 2 x 4`` FLOPs per state element, tripled for the backward.
    The chunked kernels' intra-chunk work and the convolution's ``2 x taps`` per channel are
    left out or counted with the projections (the convolution's weights are parameters)."""
    h, first = model.hidden_size, model.first_dense_layers
    linear = 6 * positions * ((model.num_layers - first) * (model.active_params_per_layer() - 2 * h)
                              + first * (model.first_dense_layer_params() - 2 * h)
                              + model.gdn_layers * model.gdn_param_delta() + model.vocab_size * h)
    attention = (6 * pairs * (model.key_channels + model.value_channels) * model.num_attention_heads
                 * model.attention_layers)
    state = model.linear_num_value_heads * model.linear_key_head_dim * model.linear_value_head_dim
    recurrence = 3 * positions * GDN_STATE_FLOPS * state * model.gdn_layers
    return {"linear": linear, "attention": attention, "recurrence": recurrence}


def step_time(model: ModelSpec, work: Workload, lay: Layout, gpu: GPUSpec, mfu: float) -> Dict[str, float]:
    """Seconds of one step (branch replay) and of the naive computation, at ``mfu``."""
    fl = step_flops(model, work.unique_positions, work.attention_pairs(True))
    # the stems are recomputed once for their exact backward (recompute_stem=True)
    stem = step_flops(model, work.num_prompts * work.stem_tokens,
                      work.num_prompts * work.stem_tokens * (work.stem_tokens + 1) / 2)
    extra = 1.0 / 3.0
    linear = fl["linear"] + extra * stem["linear"]
    # the recurrence runs at the bf16 peak, beside attention (0 without Gated DeltaNet layers)
    attention = fl["attention"] + extra * stem["attention"]
    recurrence = fl["recurrence"] + extra * stem["recurrence"]
    if lay.recompute == "full":
        linear, attention, recurrence = linear * (1 + extra), attention * (1 + extra), recurrence * (1 + extra)
    busy = lay.tp * lay.cp * lay.dp
    lin_peak = (gpu.fp8_tflops if lay.fp8 else gpu.bf16_tflops) * 1e12
    seconds = (linear / lin_peak + (attention + recurrence) / (gpu.bf16_tflops * 1e12)) / (busy * mfu)
    naive = step_flops(model, work.naive_positions, work.attention_pairs(False))
    naive_s = ((naive["linear"] / lin_peak + (naive["attention"] + naive["recurrence"]) / (gpu.bf16_tflops * 1e12))
               / (busy * mfu))
    return {"seconds": seconds, "flops": linear + attention + recurrence, "naive_seconds": naive_s,
            "naive_flops": naive["linear"] + naive["attention"] + naive["recurrence"]}
