"""``megatron-branch demo``: naive vs branch replay on a small Llama-style GPTModel.

Builds a Megatron GPTModel (RoPE, GQA, SwiGLU, RMSNorm) with the branch spec, samples
branching rollouts (several prompts, shared response stems, forked tails) and reports,
side by side in one run:

* positions (naive vs unique) and the ideal ratio;
* forward+backward time of naive (all rollouts as one padded batch, torch's fused causal
  SDPA) and of branch replay (one packed pass, cascade attention on the same fused
  kernel family), and the speed-up as a fraction of the ideal ratio;
* exactness against the stock Megatron spec, each rollout alone: max |Δ log-prob| and
  the max relative gradient difference over all parameters, for a GRPO loss.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List

import torch

from megatron_branch import losses
from megatron_branch.cpu import enable_cpu
from megatron_branch.distributed import init_distributed
from megatron_branch.logprobs import rollout_logprobs
from megatron_branch.models import build_gpt, llama_config
from megatron_branch.naive import batched_rollout_logprobs
from megatron_branch.synthetic import branching_rollouts
from megatron_branch.tree import BranchTree
from megatron_branch.verify import check_against_naive


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


def _grpo_loss(batch, num_rollouts: int) -> Callable[[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    rewards = torch.rand(num_rollouts, generator=gen)
    group_size = num_rollouts // len(set(batch.group))
    advantages = losses.grpo_advantages(rewards, group_size)
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)

    def loss_fn(lp: torch.Tensor) -> torch.Tensor:
        return losses.grpo_policy_loss(lp, lp.detach(), advantages, mask)[0]

    return loss_fn


def _time(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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

    def naive_step():
        model.zero_grad(set_to_none=True)
        loss_fn(batched_rollout_logprobs(model, batch.sequences)).backward()

    def branch_step():
        model.zero_grad(set_to_none=True)
        loss_fn(rollout_logprobs(model, tree)).backward()

    naive_step(), branch_step()  # warm-up
    t_naive, t_branch = [], []
    for i in range(cfg.repeats):
        echo(f"timing forward+backward: repeat {i + 1}/{cfg.repeats}")
        t_naive.append(_time(naive_step))
        t_branch.append(_time(branch_step))
    tn, tb = statistics.median(t_naive), statistics.median(t_branch)
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
        "naive_kernel": "torch SDPA (fused causal, padded batch)",
        "branch_kernel": f"{cfg.backend} tree attention",
        "max_abs_logprob_diff": report.max_abs_logprob_diff,
        "loss_rel_diff": report.loss_rel_diff,
        "max_rel_grad_diff": report.max_rel_grad_diff,
        "worst_param": report.worst_param,
    }
    echo("")
    echo(f"{'':28s}{'naive':>14s}{'branch replay':>16s}")
    echo(f"{'token positions':28s}{tree.naive_positions:>14d}{tree.unique_positions:>16d}")
    echo(f"{'fwd+bwd seconds (median)':28s}{tn:>14.3f}{tb:>16.3f}")
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
    parser.add_argument("--quick", action="store_true", help="small shapes (seconds; used by the tests)")
    parser.add_argument("--backend", choices=["cascade", "dense"], default=None,
                        help="tree attention backend (default: cascade)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (median is reported)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the numbers as JSON")
