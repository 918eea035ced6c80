"""``megatron-branch bench``: branch replay vs naive and peer methods, in one run.

For every shape (rollouts per prompt G, prompt/response ratio, a multi-level tree, a
batch with no sharing, a Mixture-of-Experts model) every method runs forward+backward of
one GRPO-style loss on the same weights. MoE shapes use Megatron's MoE layer (sequential
experts, the load-balancing and z losses on): the naive batch masks its padding out of
the router statistics and the tree methods weight tokens by multiplicity, so all agree.
Reported per method: median time, speed-up vs naive, the ideal FLOP ratio (naive
per-rollout FLOPs / the tree's FLOPs) and the fraction of it reached, estimated
FLOPs, peak memory (a separate run) and the max relative gradient difference vs naive.
Times are interleaved across methods and repeated; only ratios are meaningful on a
noisy machine. Output: a table, ``bench.json`` and ``bench.png``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional

import torch

from megatron_branch import losses
from megatron_branch.flops import ModelShape, causal_pairs, step_flops
from megatron_branch.bench.methods import prepare_methods
from megatron_branch.cpu import enable_cpu
from megatron_branch.distributed import init_distributed
from megatron_branch.memory import PeakMemory
from megatron_branch.models import build_gpt, llama_config
from megatron_branch.progress import Progress
from megatron_branch.synthetic import RolloutBatch, branching_rollouts
from megatron_branch.verify import compare_grads, grads

SCHEMA_VERSION = 1


@dataclass
class Shape:
    """One benchmark workload."""

    name: str
    prompt_lengths: List[int]
    branching: List[int]
    segment_lengths: List[int]
    distinct_roots: bool = False  # first tokens all different: nothing is shared
    moe: bool = False  # run on the Mixture-of-Experts model (BenchConfig.moe_experts, moe_topk)

    def batch(self, vocab: int, seed: int) -> RolloutBatch:
        batch = branching_rollouts(self.prompt_lengths, self.branching, self.segment_lengths, vocab, seed=seed)
        if self.distinct_roots:
            for i, seq in enumerate(batch.sequences):
                seq[0] = i % vocab
        return batch


@dataclass
class BenchConfig:
    """Model and workloads; :meth:`quick` is the small setting (< 3 minutes on 2 cores)."""

    num_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 8
    num_query_groups: int = 4
    vocab_size: int = 512
    chunk_tokens: int = 1024
    repeats: int = 3
    seed: int = 0
    shapes: List[Shape] = field(default_factory=list)
    moe_experts: int = 8  # MoE shapes: experts per layer, each of width top-k x ... = the dense FFN / top-k
    moe_topk: int = 2

    @classmethod
    def full(cls) -> "BenchConfig":
        resp = 128
        shapes = [Shape(f"G={g} p/r=16", [16 * resp], [g], [resp]) for g in (4, 8, 16, 32)]
        shapes += [Shape(f"G=16 p/r={r}", [r * 64], [16], [64]) for r in (1, 4, 64)]
        shapes += [
            Shape("multi-level 1024+2x64+8x128", [1024], [2, 8], [64, 128]),
            Shape("no sharing 16x1024", [512] * 16, [1], [512], distinct_roots=True),
            Shape("MoE 8x top-2, G=16 p/r=16", [16 * resp], [16], [resp], moe=True),
        ]
        return cls(shapes=shapes)

    @classmethod
    def quick(cls) -> "BenchConfig":
        resp = 32
        shapes = [Shape(f"G={g} p/r=16", [16 * resp], [g], [resp]) for g in (4, 16, 32)]
        shapes += [Shape(f"G=16 p/r={r}", [r * 16], [16], [16]) for r in (1, 4, 64)]
        shapes += [
            Shape("multi-level 256+2x16+8x32", [256], [2, 8], [16, 32]),
            Shape("no sharing 16x256", [128] * 16, [1], [128], distinct_roots=True),
            Shape("MoE 8x top-2, G=16 p/r=16", [16 * resp], [16], [resp], moe=True),
        ]
        return cls(hidden_size=128, num_attention_heads=4, num_query_groups=2, vocab_size=256,
                   chunk_tokens=256, repeats=1, shapes=shapes)


def _loss(batch: RolloutBatch):
    num = len(batch.sequences)
    gen = torch.Generator().manual_seed(1)
    adv = losses.grpo_advantages(torch.rand(num, generator=gen), num)
    prompts = [max(p, 1) for p in batch.prompt_lengths]
    mask = losses.response_mask(batch.lengths, prompts)
    tokens = mask.sum()

    def loss_fn(lp, ids):
        return losses.ppo_policy_loss(lp, lp.detach(), adv[ids], mask[ids], global_tokens=tokens)[0]

    return loss_fn


def _models(cfg: BenchConfig, moe: bool = False) -> Dict[str, torch.nn.Module]:
    moe_kwargs, spec = {}, {}
    if moe:  # same active FFN width as the dense model: top-k experts of width ffn / k
        moe_kwargs = dict(num_moe_experts=cfg.moe_experts, moe_router_topk=cfg.moe_topk,
                          moe_ffn_hidden_size=3 * cfg.hidden_size // cfg.moe_topk, moe_aux_loss_coeff=0.01,
                          moe_z_loss_coeff=1e-3, moe_token_dispatcher_type="allgather")
        spec = {"num_experts": cfg.moe_experts, "moe_grouped_gemm": False}
    config = llama_config(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                          num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
                          **moe_kwargs)
    models = {b: build_gpt(config, cfg.vocab_size, spec_kwargs={"backend": b, **spec}, seed=cfg.seed)
              for b in ("cascade", "dense", "repeat_kv")}
    state = models["cascade"].state_dict()
    for m in models.values():
        m.load_state_dict(state)
    return models


def _flop_shape(config, vocab: int) -> ModelShape:
    """FLOP shape; a MoE counts the FFN width a token runs through (top-k experts)."""
    shape = ModelShape.from_config(config, vocab)
    if config.num_moe_experts:
        shape = replace(shape, ffn_hidden_size=config.moe_router_topk * config.moe_ffn_hidden_size)
    return shape


def _zero(models) -> None:
    for m in models.values():
        m.zero_grad(set_to_none=True)


def run_bench(cfg: BenchConfig, methods: Optional[List[str]] = None, echo=print) -> dict:
    """Run every shape and method; returns the JSON-ready report."""
    enable_cpu()
    init_distributed()
    kinds: Dict[bool, Dict[str, torch.nn.Module]] = {}
    per_shape = 2 + cfg.repeats
    report = {"schema_version": SCHEMA_VERSION, "config": asdict(cfg), "torch_threads": torch.get_num_threads(),
              "device": "cpu", "shapes": []}
    with Progress(len(cfg.shapes) * per_shape, "bench") as bar:
        for shape in cfg.shapes:
            if shape.moe not in kinds:
                kinds[shape.moe] = _models(cfg, shape.moe)
            models = kinds[shape.moe]
            shape_m = _flop_shape(models["cascade"].config, cfg.vocab_size)
            batch = shape.batch(cfg.vocab_size, cfg.seed)
            loss_fn = _loss(batch)
            prepared = prepare_methods(models, batch, loss_fn, cfg.chunk_tokens, methods)
            runnable = [p for p in prepared if p.step is not None]
            # exactness and warm-up
            ref = None
            diffs = {}
            for p in runnable:
                _zero(models)
                p.step()
                model = models["dense" if p.name == "dense_tree" else
                               "repeat_kv" if p.name == "prompt_once" else "cascade"]
                g = grads(model)
                if ref is None:
                    ref = g
                diffs[p.name] = max(compare_grads(g, ref).values())
            bar.update(f"{shape.name}: exactness")
            times = {p.name: [] for p in runnable}
            for _ in range(cfg.repeats):
                for p in runnable:
                    _zero(models)
                    start = time.perf_counter()
                    p.step()
                    times[p.name].append(time.perf_counter() - start)
                bar.update(f"{shape.name}: timing")
            memory = {}
            for p in runnable:
                _zero(models)
                with PeakMemory() as meter:
                    p.step()
                memory[p.name] = meter.peak_bytes
            bar.update(f"{shape.name}: memory")
            report["shapes"].append(_summarise(shape, batch, prepared, times, memory, diffs, shape_m))
    return report


def _summarise(shape, batch, prepared, times, memory, diffs, shape_m) -> dict:
    naive_ideal = step_flops(shape_m, sum(batch.lengths), sum(causal_pairs(n) for n in batch.lengths))
    ours = next(p for p in prepared if p.name == "ours")
    ideal = naive_ideal["total"] / step_flops(shape_m, ours.positions, ours.attention_pairs)["total"]
    t_naive = statistics.median(times["naive"]) if "naive" in times else None
    rows = []
    for p in prepared:
        row = {"method": p.name, "kernel": p.kernel, "positions": p.positions,
               "flops": step_flops(shape_m, p.positions, p.attention_pairs)["total"]}
        if p.step is None:
            row["skipped"] = p.skipped
        else:
            t = statistics.median(times[p.name])
            row.update(seconds=t, peak_memory_bytes=memory[p.name], max_rel_grad_diff=diffs[p.name])
            if t_naive:
                row.update(speedup=t_naive / t, fraction_of_ideal=t_naive / t / ideal)
        rows.append(row)
    return {
        "shape": shape.name, "rollouts": len(batch.sequences), "naive_positions": sum(batch.lengths),
        "unique_positions": ours.positions, "ideal_flop_ratio": ideal,
        "naive_flops_unpadded": naive_ideal["total"], "methods": rows,
    }


def format_table(report: dict) -> str:
    """The terminal table."""
    lines = []
    head = f"{'method':<12s}{'seconds':>9s}{'speed-up':>9s}{'%ideal':>8s}{'GFLOP':>9s}{'peak MB':>9s}{'grad diff':>11s}"
    for s in report["shapes"]:
        lines.append(f"\n{s['shape']}: {s['rollouts']} rollouts, naive {s['naive_positions']} / unique "
                     f"{s['unique_positions']} positions, ideal FLOP ratio {s['ideal_flop_ratio']:.2f}x")
        lines.append(head)
        for r in s["methods"]:
            if "skipped" in r:
                lines.append(f"{r['method']:<12s}  skipped: {r['skipped']}")
                continue
            lines.append(
                f"{r['method']:<12s}{r['seconds']:>9.3f}{r.get('speedup', 0):>8.2f}x"
                f"{100 * r.get('fraction_of_ideal', 0):>7.0f}%{r['flops'] / 1e9:>9.1f}"
                f"{r['peak_memory_bytes'] / 2**20:>9.1f}{r['max_rel_grad_diff']:>11.1e}"
            )
    lines.append("\nkernels: " + "; ".join(f"{r['method']}: {r['kernel']}" for r in report["shapes"][0]["methods"]))
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Speed-up vs the ideal FLOP ratio per method, and peak memory vs naive."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    names = [r["method"] for r in report["shapes"][0]["methods"] if r["method"] != "naive"]
    top = 1.0
    for name in names:
        xs, ys = [], []
        for s in report["shapes"]:
            r = next(r for r in s["methods"] if r["method"] == name)
            if "speedup" in r:
                xs.append(s["ideal_flop_ratio"])
                ys.append(r["speedup"])
        ax1.plot(xs, ys, "o", label=name)
        top = max([top] + xs + ys)
    ax1.plot([1, top], [1, top], "k--", lw=1, label="ideal (FLOP ratio)")
    ax1.set_xscale("log"), ax1.set_yscale("log")
    ax1.set_xlabel("ideal FLOP ratio (naive / tree)"), ax1.set_ylabel("measured speed-up vs naive")
    ax1.set_title("fwd+bwd speed-up, one run per shape"), ax1.legend(fontsize=8)
    labels = [s["shape"] for s in report["shapes"]]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        vals = []
        for s in report["shapes"]:
            naive = next(r for r in s["methods"] if r["method"] == "naive")
            r = next(r for r in s["methods"] if r["method"] == name)
            vals.append(r.get("peak_memory_bytes", 0) / max(naive.get("peak_memory_bytes", 1), 1))
        ax2.bar([j + i * width for j in range(len(labels))], vals, width, label=name)
    ax2.set_xticks([j + 0.4 for j in range(len(labels))], labels, rotation=35, ha="right", fontsize=7)
    ax2.set_yscale("log")
    ax2.axhline(1.0, color="k", lw=1, ls="--")
    ax2.set_ylabel("peak memory / naive (log)"), ax2.set_title("peak memory (CPU live tensor bytes)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    cfg = BenchConfig.quick() if args.quick else BenchConfig.full()
    if args.repeats:
        cfg.repeats = args.repeats
    if args.chunk_tokens:
        cfg.chunk_tokens = args.chunk_tokens
    report = run_bench(cfg, args.methods)
    print(format_table(report))
    os.makedirs(args.out, exist_ok=True)
    json_path, png_path = os.path.join(args.out, "bench.json"), os.path.join(args.out, "bench.png")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    plot(report, png_path)
    print(f"\nwrote {json_path} and {png_path}")
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="small model and shapes (< 3 minutes on 2 cores)")
    parser.add_argument("--out", default="bench_out", help="directory for bench.json and bench.png")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per method (median)")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="streaming replay budget")
    parser.add_argument("--methods", nargs="+", default=None,
                        choices=["naive", "packed", "prompt_once", "dense_tree", "ours", "ours_stream"],
                        help="subset of methods (naive is the reference and should be included)")
