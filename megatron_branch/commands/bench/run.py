"""``megatron-branch bench``: branch replay vs naive and peer methods, in one run.

For every shape (rollouts per prompt G, prompt/response ratio, a multi-level tree, a
many-segment agentic forest, a long-prompt batch, a batch with no sharing, a
Mixture-of-Experts model) every method runs forward+backward of one GRPO-style loss on
the same weights. The naive reference is a sweep: every rollout in full in micro-batches
of every power of two below the group and all rollouts (gradient accumulation), each
reported; the fastest (by median) is the reference for every speed-up. Tree methods'
times include building their tree. Every time is the median of ``repeats`` interleaved
runs with min and max (after the first, each in a seeded shuffled order: :func:`timing_order`);
speed-ups are per-repeat ratios against the reference run side by side (median, min,
max). MoE shapes use Megatron's MoE layer (sequential experts, the load-balancing and z
losses on): the naive batch masks its padding out of the router statistics and the tree
methods weight tokens by multiplicity, so all agree; their naive is the single batch only
(micro-batches would change the per-batch router statistics). Reported per method: time
and speed-up vs the fastest naive (median, min, max), the ideal FLOP ratio (naive
per-rollout FLOPs / the tree's FLOPs) and the fraction of it reached, estimated FLOPs,
peak memory (measured in the untimed first run, which also checks exactness) and the max
relative gradient difference vs ``naive_mb1``. Only ratios are meaningful on a noisy
machine; the presets run torch on one thread (``--threads``), and glibc keeps freed memory
for reuse (``--allocator``, :mod:`megatron_branch.commands.bench.allocator`) so that no
method's large tensors are page-faulted again every step. Every repeat also times the stock
stack's fixed cost per pass (a naive step on one two-token rollout), and ours and streaming
are reported against the speed-ups that cost allows (:mod:`megatron_branch.commands.bench.fixed_cost`).
``profile`` adds a torch.profiler breakdown of where ours' gap to the ideal ratio goes
(:mod:`megatron_branch.commands.bench.profile`); ``peer`` compares with the real
``prefix_grouper`` package on a Hugging Face Llama (:mod:`megatron_branch.commands.bench.peer`).
Output: a table, ``bench.json`` and ``bench.png``; ``--publish`` also merges the run into its
configuration's file in the results folder (:mod:`megatron_branch.commands.bench.results`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional

import torch

from megatron_branch import losses
from megatron_branch._megatron import gdn_unavailable_reason, megatron_core_release
from megatron_branch.commands.bench import allocator, results
from megatron_branch.commands.bench.fixed_cost import add_bounds, fixed_cost_step, time_fixed_cost
from megatron_branch.commands.bench.methods import prepare_methods
from megatron_branch.commands.bench.peer import format_peer, run_peer
from megatron_branch.commands.bench.profile import format_profile, profile_gap
from megatron_branch.commands.bench.stats import spread
from megatron_branch.commands.bench.table import config_label, markdown
from megatron_branch.commands.bench.thd import run_thd
from megatron_branch.commands.preflight import preset_default
from megatron_branch.commands.progress import Progress
from megatron_branch.commands.synthetic import RolloutBatch, branching_rollouts
from megatron_branch.cpu import enable_cpu
from megatron_branch.distributed import init_distributed
from megatron_branch.flops import ModelShape, causal_pairs, step_flops
from megatron_branch.peak_memory import PeakMemory
from megatron_branch.reference.agreement import compare_grads, grads
from megatron_branch.spec.builders import build_gpt, hybrid_config, llama_config
from megatron_branch.tree import BranchTree

SCHEMA_VERSION = 2


@dataclass
class Shape:
    """One benchmark workload."""

    name: str
    prompt_lengths: List[int]
    branching: List[int]
    segment_lengths: List[int]
    distinct_roots: bool = False  # first tokens all different: nothing is shared
    moe: bool = False  # run on the Mixture-of-Experts model (BenchConfig.moe_experts, moe_topk)
    hybrid: bool = False  # run on the Gated DeltaNet hybrid model (GDN, attention, ...; megatron-core >= 0.19)

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
    dense_max_score_bytes: int = 256 << 20  # dense_tree is skipped above this many [U, U] mask bytes
    profile_shapes: List[str] = field(default_factory=list)  # shapes whose gap to the ideal is profiled
    peer: bool = False  # the prefix_grouper comparison (Hugging Face Llama)
    peer_shapes: List[Shape] = field(default_factory=list)
    # the packed-batch drop-in (mb.packed_logprobs) vs the stock THD forward on the same batch
    thd_shapes: List[Dict] = field(default_factory=list)
    # torch intra-op threads (None: torch's default). The presets use 1: on a small machine shared with
    # other jobs, multi-threaded kernels wait on descheduled threads and timings scatter by 10x.
    threads: Optional[int] = None
    # "keep": glibc keeps freed memory for reuse, as a GPU's caching allocator does (large tensors are
    # otherwise page-faulted again every step, which penalises whichever method has the biggest ones);
    # "default": the process's allocator as it is (see commands/bench/allocator.py)
    allocator: str = allocator.KEEP

    @classmethod
    def full(cls) -> "BenchConfig":
        resp = 64
        shapes = [Shape(f"G={g} p/r=16", [16 * resp], [g], [resp]) for g in (4, 8, 16, 32)]
        shapes += [Shape(f"G=16 p/r={r}", [r * 64], [16], [64]) for r in (1, 4)]
        shapes += [
            Shape("multi-level 1024+2x64+8x128", [1024], [2, 8], [64, 128]),
            Shape("agentic forest 4x128, 3 turns x16, 4-way", [128] * 4, [4, 4, 4], [16, 16, 16]),
            Shape("16x(4096+96)", [4096], [16], [96]),
            Shape("no sharing 16x1024", [512] * 16, [1], [512], distinct_roots=True),
            Shape("MoE 8x top-2, G=16 p/r=16", [16 * resp], [16], [resp], moe=True),
            Shape("GDN hybrid, G=16 p/r=16", [16 * resp], [16], [resp], hybrid=True),
        ]
        peer_shapes = [Shape("G=16 1024+64", [1024], [16], [64]),
                       Shape("2 prompts, G=8 512+128", [512] * 2, [8], [128]),
                       Shape("G=8 512+256", [512], [8], [256])]
        profile = ["G=16 p/r=16", "agentic forest 4x128, 3 turns x16, 4-way", "16x(4096+96)"]
        # hidden 128 (head dim 32): the naive micro-batch sweep on 16 x (4096 + 96) and 256-rollout forests
        # must fit a ~25-minute run on 2 shared cores (at 3 repeats; 5 take about half as long again)
        thd = [dict(seqs=16, prompt=512, response=512, shared=False), dict(seqs=16, prompt=1024, response=64, shared=True)]
        # 5 repeats: on 2 shared cores one method's run can be 15-20% slow in a repeat, and a median of 3 paired
        # ratios moved shapes by 10-25 points between runs (e.g. the forest at hidden 256 / 2 threads: 69% of
        # ideal published, 85% over 7 side-by-side repeats)
        return cls(hidden_size=128, num_attention_heads=4, num_query_groups=2, vocab_size=512, shapes=shapes,
                   repeats=5, threads=1, profile_shapes=profile, peer=True, peer_shapes=peer_shapes, thd_shapes=thd)

    @classmethod
    def quick(cls) -> "BenchConfig":
        resp = 32
        shapes = [Shape(f"G={g} p/r=16", [16 * resp], [g], [resp]) for g in (4, 16)]
        shapes += [Shape(f"G=16 p/r={r}", [r * 16], [16], [16]) for r in (1, 4)]
        shapes += [
            Shape("multi-level 256+2x16+8x32", [256], [2, 8], [16, 32]),
            Shape("agentic forest 2x32, 3 turns x8, 4-way", [32] * 2, [4, 4, 4], [8, 8, 8]),
            Shape("no sharing 16x256", [128] * 16, [1], [128], distinct_roots=True),
            Shape("MoE 8x top-2, G=16 p/r=16", [16 * resp], [16], [resp], moe=True),
            Shape("GDN hybrid, G=16 p/r=16", [16 * resp], [16], [resp], hybrid=True),
        ]
        return cls(hidden_size=128, num_attention_heads=4, num_query_groups=2, vocab_size=256,
                   chunk_tokens=256, repeats=3, shapes=shapes, threads=1, profile_shapes=["G=16 p/r=16"],
                   peer=True, peer_shapes=[Shape("G=8 256+32", [256], [8], [32])],
                   thd_shapes=[dict(seqs=8, prompt=128, response=128, shared=False)])


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


def _models(cfg: BenchConfig, moe: bool = False, hybrid: bool = False) -> Dict[str, torch.nn.Module]:
    moe_kwargs, spec = {}, {}
    if moe:  # same active FFN width as the dense model: top-k experts of width ffn / k
        moe_kwargs = dict(num_moe_experts=cfg.moe_experts, moe_router_topk=cfg.moe_topk,
                          moe_ffn_hidden_size=3 * cfg.hidden_size // cfg.moe_topk, moe_aux_loss_coeff=0.01,
                          moe_z_loss_coeff=1e-3, moe_token_dispatcher_type="allgather")
        spec = {"num_experts": cfg.moe_experts, "moe_grouped_gemm": False}
    dims = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups)
    if hybrid:  # GDN and attention layers alternating, GDN heads of the attention head size
        head = cfg.hidden_size // cfg.num_attention_heads
        config = hybrid_config(**dims, linear_attention_freq=2, linear_key_head_dim=head, linear_value_head_dim=head,
                               linear_num_key_heads=cfg.num_query_groups,
                               linear_num_value_heads=cfg.num_attention_heads)
    else:
        config = llama_config(**dims, **moe_kwargs)
    models = {b: build_gpt(config, cfg.vocab_size, spec_kwargs={"backend": b, **spec}, seed=cfg.seed)
              for b in ("cascade", "dense", "repeat_kv")}
    state = models["cascade"].state_dict()
    for m in models.values():
        m.load_state_dict(state)
    return models


def _flop_shape(config, vocab: int, model=None) -> ModelShape:
    """FLOP shape; a MoE counts the FFN width a token runs through (top-k experts); a
    hybrid counts its decoder layers' matmul weights and its attention layers."""
    shape = ModelShape.from_config(config, vocab)
    if config.num_moe_experts:
        shape = replace(shape, ffn_hidden_size=config.moe_router_topk * config.moe_ffn_hidden_size)
    if getattr(config, "experimental_attention_variant", None) == "gated_delta_net" and model is not None:
        layers = model.decoder.layers
        weights = sum(p.numel() for layer in layers for n, p in layer.named_parameters()
                      if p.dim() == 2 and not n.endswith("norm.weight"))
        attention = sum(1 for layer in layers if not hasattr(layer.self_attention, "gated_delta_rule"))
        shape = replace(shape, attention_layers=attention, decoder_linear_params=weights)
    return shape


def _zero(models) -> None:
    for m in models.values():
        m.zero_grad(set_to_none=True)


def _model_for(name: str) -> str:
    return "dense" if name == "dense_tree" else "repeat_kv" if name == "prompt_once" else "cascade"


def run_bench(cfg: BenchConfig, methods: Optional[List[str]] = None, echo=print, verbose: bool = False) -> dict:
    """Run every shape and method (then the profile and the peer comparison if configured);
    returns the JSON-ready report. Progress shows as a bar on a terminal and as plain lines
    elsewhere; ``verbose`` adds the bar off a terminal and the profiler's own output."""
    enable_cpu()
    init_distributed()
    host_allocator = allocator.apply(cfg.allocator)
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        report = _run_bench(cfg, methods, echo, verbose)
        report["allocator"] = host_allocator
        return report
    finally:
        torch.set_num_threads(threads)


def _run_bench(cfg: BenchConfig, methods: Optional[List[str]], echo, verbose: bool = False) -> dict:
    kinds: Dict[tuple, Dict[str, torch.nn.Module]] = {}
    fixed_steps = {}  # per model kind: the stock step on a two-token rollout (fixed_cost.py)
    per_shape = 1 + cfg.repeats
    report = {"schema_version": SCHEMA_VERSION, "config": asdict(cfg), "torch_threads": torch.get_num_threads(),
              "torch_version": torch.__version__, "megatron_core_version": megatron_core_release(),
              "machine": _machine(), "device": "cpu",
              "method_order": "listed, then shuffled per repeat (seeded)", "shapes": []}
    prepared_by_shape = {}
    started = time.perf_counter()
    with Progress(len(cfg.shapes) * per_shape, "bench", verbose=verbose) as bar:
        for shape in cfg.shapes:
            if shape.hybrid and gdn_unavailable_reason():
                skipped = {"shape": shape.name, "skipped": gdn_unavailable_reason()}
                report.setdefault("skipped_shapes", []).append(skipped)
                bar.update(f"{shape.name}: skipped", per_shape)
                continue
            kind = (shape.moe, shape.hybrid)
            if kind not in kinds:
                kinds[kind] = _models(cfg, *kind)
                fixed_steps[kind] = {m: fixed_cost_step(kinds[kind], cfg.vocab_size, _loss, m)
                                     for m in ("naive", "ours")}
            models = kinds[kind]
            shape_m = _flop_shape(models["cascade"].config, cfg.vocab_size, models["cascade"])
            batch = shape.batch(cfg.vocab_size, cfg.seed)
            loss_fn = _loss(batch)
            prepared = prepare_methods(models, batch, loss_fn, cfg.chunk_tokens, methods, cfg.dense_max_score_bytes)
            runnable = [p for p in prepared if p.step is not None]
            # exactness, peak memory and warm-up in one untimed run
            ref = None
            diffs, memory = {}, {}
            _zero(models)
            for fixed_step in fixed_steps[kind].values():  # warm
                fixed_step()
            for p in runnable:
                _zero(models)
                with PeakMemory() as meter:
                    p.step()
                memory[p.name] = meter.peak_bytes
                g = grads(models[_model_for(p.name)])
                if ref is None:
                    ref = g
                diffs[p.name] = max(compare_grads(g, ref).values())
            bar.update(f"{shape.name}: exactness")
            times = {p.name: [] for p in runnable}
            fixed, fixed_ours = [], []
            for repeat in range(cfg.repeats):
                fixed.append(time_fixed_cost(fixed_steps[kind]["naive"], lambda: _zero(models)))
                fixed_ours.append(time_fixed_cost(fixed_steps[kind]["ours"], lambda: _zero(models)))
                for p in timing_order(runnable, repeat):
                    _zero(models)
                    start = time.perf_counter()
                    p.step()
                    times[p.name].append(time.perf_counter() - start)
                bar.update(f"{shape.name}: timing")
            report["shapes"].append(_summarise(shape, batch, prepared, times, memory, diffs, shape_m, fixed,
                                               fixed_ours))
            prepared_by_shape[shape.name] = (models, batch, loss_fn, prepared, shape_m)
    report["seconds_main"] = time.perf_counter() - started
    if cfg.profile_shapes:
        report["profile"] = []
        for name in cfg.profile_shapes:
            if name not in prepared_by_shape:
                continue
            summary = next(s for s in report["shapes"] if s["shape"] == name)
            report["profile"].append(profile_gap(name, summary, *prepared_by_shape[name][:4], verbose=verbose))
    if cfg.peer:
        report["peer"] = run_peer(cfg, echo=echo)
    if cfg.thd_shapes:
        report["thd"] = run_thd(_models(cfg)["cascade"], cfg.vocab_size, cfg.thd_shapes, cfg.repeats, echo=echo)
    report["seconds_total"] = time.perf_counter() - started
    return report


def timing_order(items: List, repeat: int) -> List:
    """The order ``items`` are timed in at repeat ``repeat``: the listed order first, then a
    shuffle seeded by the repeat (the same on every run).

    A step's time depends on the step before it (what the previous method left in the
    caches and the allocator: at hidden 512 on 2 threads the forest's one pass was 80% of
    ideal timed right after ``dense_tree`` in every repeat, 89% with only naive before
    it). A fixed order makes one neighbour's cost land on the same method in every
    repeat, where the median cannot drop it; shuffling gives every method varying
    neighbours (a rotation would not: it keeps each method's predecessor)."""
    order = list(items)
    if repeat:
        random.Random(repeat).shuffle(order)
    return order


def _machine() -> dict:
    """What the timings ran on: CPUs and their load when the run started (1/5/15 min)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpus": os.cpu_count(), "load_average": list(load) if load else None}


def _summarise(shape, batch, prepared, times, memory, diffs, shape_m, fixed, fixed_ours) -> dict:
    naive_ideal = step_flops(shape_m, sum(batch.lengths), sum(causal_pairs(n) for n in batch.lengths))
    ours = next(p for p in prepared if p.name == "ours")
    ideal = naive_ideal["total"] / step_flops(shape_m, ours.positions, ours.attention_pairs)["total"]
    sweep = [n for n in times if n.startswith("naive_mb")]
    best = min(sweep, key=lambda n: statistics.median(times[n])) if sweep else None
    rows = []
    for p in prepared:
        row = {"method": p.name, "kernel": p.kernel, "positions": p.positions,
               "flops": step_flops(shape_m, p.positions, p.attention_pairs)["total"]}
        if p.step is None:
            row["skipped"] = p.skipped
        else:
            t = times[p.name]
            row.update(seconds=spread(t), peak_memory_bytes=memory[p.name], max_rel_grad_diff=diffs[p.name])
            if best:
                ratios = [a / b for a, b in zip(times[best], t)]  # paired: same repeat, side by side
                row["speedup"] = spread(ratios)
                row["fraction_of_ideal"] = {k: v / ideal for k, v in row["speedup"].items()}
        rows.append(row)
    _streaming_costs(rows, prepared, times)
    add_bounds(rows, best, len(batch.sequences), ideal, times, fixed)
    return {
        "shape": shape.name, "rollouts": len(batch.sequences), "segments": _segments(batch),
        "naive_positions": sum(batch.lengths), "unique_positions": ours.positions, "ideal_flop_ratio": ideal,
        "naive_flops_unpadded": naive_ideal["total"], "naive_reference": best,
        "fixed_cost_seconds": spread(fixed), "fixed_cost_ours_seconds": spread(fixed_ours), "methods": rows,
    }


def _streaming_costs(rows, prepared, times) -> None:
    """Streaming rows get their units and their cost against one pass, paired per repeat:
    ``fraction_of_one_pass`` (one pass's time / streaming's), ``seconds_per_chunk``
    ((streaming - one pass) / chunk units) and ``seconds_per_unit`` ((streaming - one pass)
    / (units - 1): what each pass after the first adds, stems included, to set beside the
    fixed cost per pass)."""
    if "ours" not in times:
        return
    by_name = {p.name: p for p in prepared}
    for row in rows:
        p = by_name[row["method"]]
        if p.chunk_tokens is None or p.name not in times or not p.stats:
            continue
        one, t = times["ours"], times[p.name]
        row.update(chunk_tokens=p.chunk_tokens, **p.stats)
        row["fraction_of_one_pass"] = spread([a / b for a, b in zip(one, t)])
        row["seconds_per_chunk"] = spread([(b - a) / max(p.stats["chunks"], 1) for a, b in zip(one, t)])
        extra = max(p.stats["chunks"] + p.stats["stems"] - 1, 1)
        row["seconds_per_unit"] = spread([(b - a) / extra for a, b in zip(one, t)])


def _segments(batch) -> int:
    return len(BranchTree.from_sequences(batch.sequences).segments)


def _fmt_spread(d: dict, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return (fmt.format(d["median"] * scale) + " [" + fmt.format(d["min"] * scale) + "-"
            + fmt.format(d["max"] * scale) + "]")


def format_table(report: dict) -> str:
    """The terminal table: medians with [min-max] over the repeats."""
    lines = []
    head = (f"{'method':<14s}{'seconds [min-max]':>26s}{'speed-up [min-max]':>24s}{'%ideal':>8s}{'GFLOP':>8s}"
            f"{'peak MB':>9s}{'grad diff':>10s}")
    for s in report["shapes"]:
        lines.append(f"\n{s['shape']}: {s['rollouts']} rollouts, {s.get('segments', '?')} segments, naive "
                     f"{s['naive_positions']} / unique {s['unique_positions']} positions, ideal FLOP ratio "
                     f"{s['ideal_flop_ratio']:.2f}x; reference: fastest naive = {s.get('naive_reference')}")
        lines.append(head)
        for r in s["methods"]:
            if "skipped" in r:
                lines.append(f"{r['method']:<14s}  skipped: {r['skipped']}")
                continue
            sp = r.get("speedup")
            lines.append(
                f"{r['method']:<14s}{_fmt_spread(r['seconds'], fmt='{:.3f}'):>26s}"
                f"{(_fmt_spread(sp) if sp else '-'):>24s}"
                f"{(100 * r['fraction_of_ideal']['median'] if sp else 0):>7.0f}%{r['flops'] / 1e9:>8.1f}"
                f"{r['peak_memory_bytes'] / 2**20:>9.1f}{r['max_rel_grad_diff']:>10.1e}"
            )
        for r in s["methods"]:
            if "fraction_of_bound" in r:
                ours_s = (f" (ours' one pass on it {1e3 * s['fixed_cost_ours_seconds']['median']:.1f} ms)"
                          if "fixed_cost_ours_seconds" in s else "")
                stock_s = 1e3 * s["fixed_cost_seconds"]["median"]
                lines.append(f"  fixed cost of a pass through the stack {stock_s:.1f} ms{ours_s}: "
                             f"{r['method']} at most {r['fixed_cost_bound']['median']:.2f}x with it, reaches "
                             f"{100 * r['fraction_of_bound']['median']:.0f}% of that")
            if "fraction_of_one_pass" in r:
                f, c = r["fraction_of_one_pass"], r["seconds_per_chunk"]
                unit = (f", {1e3 * r['seconds_per_unit']['median']:+.1f} ms per unit after the first"
                        if "seconds_per_unit" in r else "")
                bound = (f"; at most {100 * r['one_pass_bound']['median']:.0f}% with the fixed cost per unit, "
                         f"{100 * r['fraction_of_one_pass_bound']['median']:.0f}% of that"
                         if "one_pass_bound" in r else "")
                lines.append(f"  {r['method']}: budget {r['chunk_tokens']}, {r['chunks']} chunks + {r['stems']} stems; "
                             f"{100 * f['median']:.0f}% of one pass's speed "
                             f"[{100 * f['min']:.0f}-{100 * f['max']:.0f}], "
                             f"{1e3 * c['median']:+.1f} ms per chunk{unit}{bound}")
    for s in report.get("skipped_shapes", []):
        lines.append(f"\n{s['shape']}: skipped: {s['skipped']}")
    lines.append("\nkernels: " + "; ".join(f"{r['method']}: {r['kernel']}" for r in report["shapes"][0]["methods"]))
    if report.get("profile"):
        lines.append(format_profile(report["profile"]))
    if report.get("peer"):
        lines.append(format_peer(report["peer"]))
    for row in report.get("thd", []):
        r = row["ratio_ours_over_stock"]
        lines.append(f"THD drop-in, {row['seqs']} x ({row['prompt']} + {row['response']}) "
                     f"{'shared prompt' if row['shared'] else 'nothing shared'}: mb.packed_logprobs takes "
                     f"{r['median']:.3f}x ({r['min']:.3f}-{r['max']:.3f}) the stock THD forward+backward")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Speed-up vs the fastest naive against the ideal FLOP ratio (median, min-max bars) per
    method, and peak memory vs that naive."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    names = []
    for s in report["shapes"]:
        for r in s["methods"]:
            if not r["method"].startswith("naive") and r["method"] not in names:
                names.append(r["method"])
    top = 1.0
    for name in names:
        xs, ys, lo, hi = [], [], [], []
        for s in report["shapes"]:
            r = next((r for r in s["methods"] if r["method"] == name), None)
            if r and "speedup" in r:
                xs.append(s["ideal_flop_ratio"])
                ys.append(r["speedup"]["median"])
                lo.append(r["speedup"]["median"] - r["speedup"]["min"])
                hi.append(r["speedup"]["max"] - r["speedup"]["median"])
        ax1.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=2, label=name)
        top = max([top] + xs + ys)
    ax1.plot([1, top], [1, top], "k--", lw=1, label="ideal (FLOP ratio)")
    ax1.set_xscale("log"), ax1.set_yscale("log")
    ax1.set_xlabel("ideal FLOP ratio (naive / tree)")
    ax1.set_ylabel("speed-up vs the fastest naive micro-batching")
    ax1.set_title("fwd+bwd speed-up (median, min-max of paired repeats)"), ax1.legend(fontsize=8)
    labels = [s["shape"] for s in report["shapes"]]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        vals = []
        for s in report["shapes"]:
            naive = next((r for r in s["methods"] if r["method"] == s.get("naive_reference")), None)
            r = next((r for r in s["methods"] if r["method"] == name), {})
            base = naive.get("peak_memory_bytes", 1) if naive else 1
            vals.append(r.get("peak_memory_bytes", 0) / max(base, 1))
        ax2.bar([j + i * width for j in range(len(labels))], vals, width, label=name)
    ax2.set_xticks([j + 0.4 for j in range(len(labels))], labels, rotation=35, ha="right", fontsize=7)
    ax2.set_yscale("log")
    ax2.axhline(1.0, color="k", lw=1, ls="--")
    ax2.set_ylabel("peak memory / fastest naive (log)"), ax2.set_title("peak memory (CPU live tensor bytes)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def select_shapes(shapes: List[Shape], wanted: List[str]) -> List[Shape]:
    """The shapes ``wanted`` names, in bench order (case-insensitive).

    A word that is a shape's whole name selects that shape alone ("G=16 p/r=1" is not also "G=16 p/r=16");
    any other word selects every shape whose name contains it ("G=16 p/r", "agentic").
    """
    names = {s.name.lower() for s in shapes}

    def matches(word: str, shape: Shape) -> bool:
        word = word.lower()
        return shape.name.lower() == word if word in names else word in shape.name.lower()

    missing = [w for w in wanted if not any(matches(w, s) for s in shapes)]
    if missing:
        raise ValueError(f"--shapes: {missing} match no shape; the shapes are {[s.name for s in shapes]}")
    return [s for s in shapes if any(matches(w, s) for w in wanted)]


def main(args) -> int:
    if args.table is not None:
        print(markdown(args.table))
        return 0
    if args.publish and args.quick:
        raise ValueError("--publish: a --quick run (its own small shapes) is no configuration's result; publish "
                         "runs of the full preset (--shapes and --methods may select a part of it)")
    cfg = BenchConfig.quick() if args.quick else BenchConfig.full()
    order = [s.name for s in cfg.shapes]
    if args.repeats:
        cfg.repeats = args.repeats
    if args.chunk_tokens:
        cfg.chunk_tokens = args.chunk_tokens
    if args.threads:
        cfg.threads = args.threads
    if args.hidden:
        cfg.hidden_size = args.hidden
    if args.heads:
        cfg.num_attention_heads = args.heads
        cfg.num_query_groups = min(cfg.num_query_groups, args.heads)
    if args.kv_groups:
        cfg.num_query_groups = args.kv_groups
    if args.shapes:
        cfg.shapes = select_shapes(cfg.shapes, args.shapes)
        cfg.profile_shapes = [n for n in cfg.profile_shapes if any(s.name == n for s in cfg.shapes)]
    if args.peer is not None:
        cfg.peer = args.peer
    if args.profile is False:
        cfg.profile_shapes = []
    if args.allocator:
        cfg.allocator = args.allocator
    report = results.stamp(run_bench(cfg, args.methods, verbose=args.verbose))
    print(format_table(report))
    os.makedirs(args.out, exist_ok=True)
    json_path, png_path = os.path.join(args.out, "bench.json"), os.path.join(args.out, "bench.png")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    plot(report, png_path)
    print(f"\nwrote {json_path} and {png_path}")
    if args.publish:
        path, merged = results.publish(report, args.publish, config_label(report), order)
        plot(merged, path[: -len(".json")] + ".png")
        print(f"published: {path} (and its plot) now holds this run's shapes; {args.publish}/manifest.json lists it")
    return 0


def add_arguments(parser) -> None:
    # the options left None take the preset's value (BenchConfig.full() or .quick()), stated in the help
    full, quick = BenchConfig.full(), BenchConfig.quick()
    parser.add_argument("--quick", action="store_true", help="small model and shapes (about 2 minutes on 2 cores)")
    parser.add_argument("--out", default="bench_out", help="directory for bench.json and bench.png")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed repeats per method (median) {preset_default(full.repeats, quick.repeats)}")
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help=f"streaming replay budget {preset_default(full.chunk_tokens, quick.chunk_tokens)}")
    parser.add_argument("--methods", nargs="+", default=None,
                        choices=["naive", "packed", "prompt_once", "dense_tree", "ours", "ours_stream",
                                 "ours_stream_small"],
                        help="subset of methods (naive, the micro-batch sweep, is the reference and should be "
                             "included) (default: all)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (1 steadies timings on a machine shared with other jobs) "
                             + preset_default(full.threads, quick.threads))
    parser.add_argument("--hidden", type=int, default=None,
                        help=f"model width {preset_default(full.hidden_size, quick.hidden_size)}")
    parser.add_argument("--heads", type=int, default=None,
                        help="attention heads; must divide --hidden "
                             + preset_default(full.num_attention_heads, quick.num_attention_heads))
    parser.add_argument("--kv-groups", type=int, default=None,
                        help="key/value groups (GQA); must divide --heads (default: "
                             f"{full.num_query_groups}, or --heads if fewer)")
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=None,
                        help="the prefix_grouper comparison on a Hugging Face Llama (default: on)")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="NAME",
                        help="run only these shapes: a shape's whole name selects it alone, any other word every shape "
                             "whose name contains it (e.g. 'G=16 p/r=1' agentic 4096) (default: all the preset's)")
    parser.add_argument("--table", nargs="*", default=None, metavar="JSON",
                        help="print the markdown tables and exit (runs nothing): of the results folder's manifest "
                             "(no argument: results/) or of these bench.json files / results folders; one table "
                             "per run and, for several, ours' %% of ideal and streaming's %% of one pass side by "
                             "side; then the fixed-cost bounds, and the --profile and --peer tables of the runs "
                             "that have them")
    parser.add_argument("--publish", nargs="?", const=results.DEFAULT_DIR, default=None, metavar="DIR",
                        help="also merge this run into its configuration's file in the results folder (DIR, "
                             "default results/; run from the repository root): its shapes replace that file's, "
                             "the plot is redrawn and manifest.json lists it")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                        help="profile where ours' gap to the ideal ratio goes (default: on)")
    parser.add_argument("--allocator", choices=allocator.CHOICES, default=None,
                        help="host memory: 'keep' (default) has glibc keep freed memory for reuse, as a GPU's "
                             "caching allocator does, so no method's large tensors are page-faulted again every "
                             "step; 'default' leaves the allocator as it is")
    parser.add_argument("--verbose", action="store_true",
                        help="show everything: torch.profiler's own output, and the progress bar even when stderr "
                             "is not a terminal (where otherwise a plain line every few seconds shows progress)")
