"""Memory, FLOPs and step time of one streaming branch-replay step on a parallel layout.

Memory per GPU (bytes):

* weights 2 B/param (bf16), main gradients 4 B/param (fp32), optimizer 12 B/param (fp32
  master + Adam moments) sharded over DP x CP (distributed optimizer); parameters split
  over TP x PP; FP8 adds 1 B/param of cached FP8 weights; a Mixture of Experts' routed
  experts are split over EP instead of TP (expert TP = 1) and their optimizer state over
  the expert-data-parallel ranks ``TP x CP x DP / EP``; activations and FLOPs follow the
  *active* parameters (router + top-k experts); the all-to-all time is not modelled;
* what streaming exact replay keeps (:mod:`megatron_branch.commands.planner.memory`, which counts
  what the implementation allocates and is checked rank by rank by
  ``megatron-branch bench-scale``): the path cache (this rank's share of the prompt's
  K/V plus float32 gradient accumulators), one unit's saved activations and gathered
  K/V, the larger of its logits and its attention backward's workspace, and the stems'
  log-prob leaves.

Time = FLOPs / (GPUs x peak x MFU), linear GEMMs at the FP8 peak when FP8 is on,
attention at the bf16 peak; recompute adds the recomputed forwards. PP with a single
tree per step leaves stages idle, so only TP x CP x DP GPUs count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from megatron_branch.commands.planner.memory import workload_memory
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


def memory_per_gpu(model: ModelSpec, work: Workload, lay: Layout, act_bytes: int = 2) -> Dict[str, float]:
    """Bytes per GPU by component (the largest pipeline stage): parameters, gradients and
    optimizer state, plus what the replay keeps
    (:func:`megatron_branch.commands.planner.memory.workload_memory`)."""
    layers = -(-model.num_layers // lay.pp)
    dense = (layers * model.dense_params_per_layer() + model.vocab_size * model.hidden_size) / lay.tp
    experts = layers * model.expert_params_per_layer() / lay.ep
    stage_params = dense + experts
    replay = workload_memory(model, work.prompt_len, work.rollouts, work.response_len,
                             chunk_tokens=lay.chunk_tokens, tp=lay.tp, cp=lay.cp, pp=lay.pp,
                             recompute=lay.recompute, act_bytes=act_bytes)
    return {
        "weights": stage_params * (2 + (1 if lay.fp8 else 0)),
        "grads": stage_params * 4,
        "optimizer": dense * 12 / (lay.dp * lay.cp) + experts * 12 * lay.ep / (lay.tp * lay.cp * lay.dp),
        **replay,
    }


def step_flops(model: ModelSpec, positions: float, pairs: float) -> Dict[str, float]:
    """Forward+backward FLOPs: linear (incl. output layer) and attention."""
    linear = 6 * positions * (model.num_layers * (model.active_params_per_layer() - 2 * model.hidden_size)
                              + model.vocab_size * model.hidden_size)
    attention = 12 * pairs * model.kv_channels * model.num_attention_heads * model.num_layers
    return {"linear": linear, "attention": attention}


def step_time(model: ModelSpec, work: Workload, lay: Layout, gpu: GPUSpec, mfu: float) -> Dict[str, float]:
    """Seconds of one step (branch replay) and of the naive computation, at ``mfu``."""
    fl = step_flops(model, work.unique_positions, work.attention_pairs(True))
    # the stems are recomputed once for their exact backward (recompute_stem=True)
    stem = step_flops(model, work.num_prompts * work.stem_tokens,
                      work.num_prompts * work.stem_tokens * (work.stem_tokens + 1) / 2)
    extra = 1.0 / 3.0
    linear = fl["linear"] + extra * stem["linear"]
    attention = fl["attention"] + extra * stem["attention"]
    if lay.recompute == "full":
        linear, attention = linear * (1 + extra), attention * (1 + extra)
    busy = lay.tp * lay.cp * lay.dp
    lin_peak = (gpu.fp8_tflops if lay.fp8 else gpu.bf16_tflops) * 1e12
    seconds = (linear / lin_peak + attention / (gpu.bf16_tflops * 1e12)) / (busy * mfu)
    naive = step_flops(model, work.naive_positions, work.attention_pairs(False))
    naive_s = (naive["linear"] / lin_peak + naive["attention"] / (gpu.bf16_tflops * 1e12)) / (busy * mfu)
    return {"seconds": seconds, "flops": linear + attention, "naive_seconds": naive_s,
            "naive_flops": naive["linear"] + naive["attention"]}
