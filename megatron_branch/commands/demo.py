"""``megatron-branch demo``: naive vs branch replay on a small Llama-style GPTModel.

Builds a Megatron GPTModel (RoPE, GQA, SwiGLU, RMSNorm) with the branch spec, samples
branching rollouts (several prompts, shared response stems, forked tails) and reports,
side by side in one run:

* positions (naive vs unique) and the ideal ratio;
* forward+backward time of naive (every rollout in full on torch's fused causal SDPA, in
  micro-batches of every power of two below the rollout count and of all rollouts, with
  gradient accumulation: 1, 2, 4, 8, 16 for 16 rollouts; the fastest is the reference)
  and of branch replay (one packed pass, cascade attention on the same fused kernel
  family), and the speed-up as a fraction of the ideal ratio;
* exactness against the stock Megatron spec, each rollout alone: max |Δ log-prob| and
  the max relative gradient difference over all parameters, for a GRPO loss.

Timings need a quiet machine: when the load average exceeds the CPU count the demo says
so before timing (``--quick`` is a fast exactness check).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional

import torch

from megatron_branch import losses
from megatron_branch.commands.bench.methods import causal_logprobs, naive_micro_batches
from megatron_branch.commands.preflight import preset_default
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.cpu import enable_cpu
from megatron_branch.distributed import init_distributed
from megatron_branch.reference.agreement import check_against_naive
from megatron_branch.scoring.logprobs import rollout_logprobs
from megatron_branch.spec.builders import build_gpt, llama_config
from megatron_branch.tree import BranchTree


@dataclass
class DemoConfig:
    """Shape of the demo. ``quick()`` is the small setting the test suite runs."""

    num_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 8
    num_query_groups: int = 4
    vocab_size: int = 512
    prompt_lengths: List[int] = field(default_factory=lambda: [512, 384])
    branching: List[int] = field(default_factory=lambda: [2, 8])
    segment_lengths: List[int] = field(default_factory=lambda: [32, 64])
    repeats: int = 3
    seed: int = 0
    backend: str = "cascade"

    @classmethod
    def quick(cls) -> "DemoConfig":
        return cls(
            hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128,
            prompt_lengths=[96, 64], branching=[2, 4], segment_lengths=[8, 16], repeats=1,
        )


def _grpo_loss(batch, num_rollouts: int) -> Callable[..., torch.Tensor]:
    """``loss_fn(lp, ids=all)``: a GRPO loss normalised by the global rollout count, so the
    losses of micro-batches add up to the loss of the whole batch."""
    gen = torch.Generator().manual_seed(7)
    rewards = torch.rand(num_rollouts, generator=gen)
    group_size = num_rollouts // len(set(batch.group))
    advantages = losses.grpo_advantages(rewards, group_size)
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)

    def loss_fn(lp: torch.Tensor, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        ids = torch.arange(num_rollouts) if ids is None else ids
        return losses.grpo_policy_loss(lp, lp.detach(), advantages[ids], mask[ids], global_seqs=num_rollouts)[0]

    return loss_fn


def _time(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def machine_load() -> Optional[float]:
    """The 1-minute load average, or ``None`` where the platform has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def load_warning(load: Optional[float], cpus: Optional[int]) -> Optional[str]:
    """One line warning that timings are unreliable when ``load`` exceeds ``cpus``, else ``None``.

    Args:
        load: the 1-minute load average (``None``: unknown, no warning).
        cpus: the machine's CPU count (``None``: unknown, no warning).
    """
    if load is None or not cpus or load <= cpus:
        return None
    return (f"warning: load average {load:.1f} exceeds the {cpus} cores: the timings below are unreliable on a "
            f"loaded machine (megatron-branch demo --quick is a fast exactness check)")


def run_demo(cfg: DemoConfig, echo: Callable[[str], None] = print) -> dict:
    """Run the demo and return its numbers (also printed through ``echo``)."""
    enable_cpu()
    init_distributed()
    config = llama_config(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
    )
    batch = branching_rollouts(
        cfg.prompt_lengths, cfg.branching, cfg.segment_lengths, cfg.vocab_size, seed=cfg.seed
    )
    tree = BranchTree.from_sequences(batch.sequences, vocab_size=cfg.vocab_size)
    model = build_gpt(config, cfg.vocab_size, spec_kwargs={"backend": cfg.backend}, seed=cfg.seed)
    stock = build_gpt(config, cfg.vocab_size, branch=False)
    stock.load_state_dict(model.state_dict())
    loss_fn = _grpo_loss(batch, tree.num_rollouts)
    ideal = tree.naive_positions / tree.unique_positions
    echo(
        f"model: {cfg.num_layers} layers x {cfg.hidden_size} hidden, {cfg.num_attention_heads} heads "
        f"({cfg.num_query_groups} KV groups), vocab {cfg.vocab_size}; torch threads {torch.get_num_threads()}"
    )
    echo(f"rollouts: {tree.num_rollouts} from {len(cfg.prompt_lengths)} prompts {cfg.prompt_lengths}, "
         f"branching {cfg.branching} x {cfg.segment_lengths} tokens")

    echo("checking exactness against the stock Megatron spec (each rollout alone) ...")
    report = check_against_naive(model, stock, batch.sequences, loss_fn, tree=tree)

    seqs, width = batch.sequences, tree.max_len - 1

    def naive_step(k: int) -> Callable[[], None]:
        def run():  # every rollout in full, k per micro-batch, gradient accumulation
            model.zero_grad(set_to_none=True)
            for lo in range(0, len(seqs), k):
                loss_fn(causal_logprobs(model, seqs[lo: lo + k], width), torch.arange(lo, min(lo + k, len(seqs)))
                        ).backward()
        return run

    def branch_step():  # building the tree is part of the step, as in a trainer
        model.zero_grad(set_to_none=True)
        step_tree = BranchTree.from_sequences(batch.sequences, vocab_size=cfg.vocab_size)
        loss_fn(rollout_logprobs(model, step_tree)).backward()

    sizes = naive_micro_batches(len(seqs))
    steps = {k: naive_step(k) for k in sizes}
    echo(f"naive: micro-batches of {', '.join(map(str, sizes))} rollouts (gradient accumulation); "
         f"the fastest is the reference")
    load, cpus = machine_load(), os.cpu_count()
    warning = load_warning(load, cpus)
    if warning:
        echo(warning)
    for step in (*steps.values(), branch_step):  # warm-up
        step()
    t_naive = {k: [] for k in sizes}
    t_branch = []
    for i in range(cfg.repeats):
        echo(f"timing forward+backward: repeat {i + 1}/{cfg.repeats}")
        for k, step in steps.items():
            t_naive[k].append(_time(step))
        t_branch.append(_time(branch_step))
    naive_median = {k: statistics.median(v) for k, v in t_naive.items()}
    best = min(naive_median, key=naive_median.get)
    tn, tb = naive_median[best], statistics.median(t_branch)
    speedup = tn / tb
    result = {
        "config": asdict(cfg),
        "rollouts": tree.num_rollouts,
        "naive_positions": tree.naive_positions,
        "unique_positions": tree.unique_positions,
        "ideal_ratio": ideal,
        "naive_seconds": tn,
        "branch_seconds": tb,
        "speedup": speedup,
        "fraction_of_ideal": speedup / ideal,
        "naive_micro_batch": best,
        "naive_seconds_by_micro_batch": naive_median,
        "naive_kernel": "torch SDPA (fused is_causal, right-padded micro-batches)",
        "branch_kernel": f"{cfg.backend} tree attention (tree building included)",
        "max_abs_logprob_diff": report.max_abs_logprob_diff,
        "loss_rel_diff": report.loss_rel_diff,
        "max_rel_grad_diff": report.max_rel_grad_diff,
        "worst_param": report.worst_param,
        "load_average": load,
        "cpus": cpus,
    }
    echo("")
    echo(f"{'':28s}{'naive':>14s}{'branch replay':>16s}")
    echo(f"{'token positions':28s}{tree.naive_positions:>14d}{tree.unique_positions:>16d}")
    echo(f"{'fwd+bwd seconds (median)':28s}{tn:>14.3f}{tb:>16.3f}")
    echo("naive micro-batches (rollouts: seconds): "
         + ", ".join(f"{k}: {v:.3f}" for k, v in naive_median.items()) + f"; fastest {best} is the reference")
    echo(f"speed-up {speedup:.2f}x vs ideal position ratio {ideal:.2f}x "
         f"({100 * speedup / ideal:.0f}% of ideal)")
    echo(f"exactness vs stock spec: max |d logprob| {report.max_abs_logprob_diff:.2e}, "
         f"loss rel diff {report.loss_rel_diff:.2e}, max rel grad diff {report.max_rel_grad_diff:.2e} "
         f"({report.worst_param})")
    return result


def main(args) -> int:
    cfg = DemoConfig.quick() if args.quick else DemoConfig()
    if args.backend:
        cfg.backend = args.backend
    if args.repeats:
        cfg.repeats = args.repeats
    result = run_demo(cfg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def add_arguments(parser) -> None:
    full, quick = DemoConfig(), DemoConfig.quick()
    parser.add_argument("--quick", action="store_true", help="small shapes (seconds; used by the tests)")
    parser.add_argument("--backend", choices=["cascade", "dense"], default=full.backend,
                        help="tree attention backend")
    # None: the preset's count, which --quick changes
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed repeats, the median is reported {preset_default(full.repeats, quick.repeats)}")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the numbers as JSON")
