"""``megatron-branch bench-scale``: the headline workload scaled down, measured against the
planner's memory model.

The product's claim is 16 x (128K prompt + 3K answer) on 8 GPUs with TP and CP. This runs
the same shape scaled down (``--prompt-len``, ``--rollouts``, ``--response-len``) as one
streaming exact replay step (``recompute_stem=True``, ``--chunk-tokens``) of a small
model on ``--cp`` x ``--tp`` gloo processes of this machine, measures each rank's peak
memory during the step (live tensor bytes on CPU, the allocator's high-water mark on GPU)
and the step time, and prints them next to what the planner's memory model
(:func:`megatron_branch.commands.planner.memory.replay_peak_bytes`) predicts for the same model,
layout and chunk, rank by rank. ``--json`` writes both (``measured_peak_bytes``,
``predicted_peak_bytes``: one entry per rank) with the layout. The processes share this
machine's cores: the time shows the method works at this scale, not a GPU speed. A layout
the model cannot take (``--tp`` not dividing its 4 attention heads and 2 query groups,
``--chunk-tokens`` below ``--tp x --cp``) is refused before any process starts.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch.commands.planner.memory import replay_peak_bytes
from megatron_branch.commands.planner.presets import ModelSpec
from megatron_branch.commands.progress import Progress
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.distributed import destroy_distributed, free_port, init_distributed
from megatron_branch.spec.builders import build_gpt, llama_config

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=192)
VOCAB = 512
# the run's sizes: run_bench_scale's keys and the command's flags (--prompt-len, ...)
SIZES = ("prompt_len", "rollouts", "response_len", "cp", "tp", "chunk_tokens")


def check_layout(cfg: Dict) -> None:
    """Refuse a layout the spawned processes would fail on, before any process starts.

    Args:
        cfg: the run's sizes (:data:`SIZES`), as ``run_bench_scale`` takes them.

    Raises:
        ValueError: naming the flag: a size below 1; ``--tp`` not dividing the model's
            attention heads or query groups (Megatron-Core's ``TransformerConfig`` asserts
            both); ``--chunk-tokens`` below ``--tp x --cp`` (a chunk is split over the CP
            ranks in multiples of TP for sequence parallelism, and a rank left without
            tokens fails in the replay).
    """
    for name in SIZES:
        if cfg[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {cfg[name]}")
    tp, cp, heads, groups = cfg["tp"], cfg["cp"], MODEL["num_attention_heads"], MODEL["num_query_groups"]
    fits = " or ".join(str(t) for t in range(1, groups + 1) if heads % t == 0 and groups % t == 0)
    for count, what in ((heads, "attention heads"), (groups, "query (key/value) groups")):
        if count % tp:
            raise ValueError(f"--tp {tp} does not divide the model's {count} {what}; use --tp {fits}")
    if cfg["chunk_tokens"] < tp * cp:
        raise ValueError(f"--chunk-tokens {cfg['chunk_tokens']} is below --tp {tp} x --cp {cp} = {tp * cp}: each "
                         f"chunk is split over the {tp * cp} ranks and every rank needs at least one token of it")


def validate(args) -> None:
    """:func:`check_layout` of the command's flags (``megatron-branch``'s preflight)."""
    check_layout({name: getattr(args, name) for name in SIZES})


def _workload(cfg):
    batch = branching_rollouts([cfg["prompt_len"]], [cfg["rollouts"]], [cfg["response_len"]], VOCAB, seed=0)
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    return batch, mask


def _worker(rank, world, port, cfg, out_dir):
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    mb.enable_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    init_distributed(cfg["tp"], 1, cfg["cp"])
    config = llama_config(**MODEL, tensor_model_parallel_size=cfg["tp"], context_parallel_size=cfg["cp"],
                          sequence_parallel=cfg["tp"] > 1)
    model = build_gpt(config, VOCAB, seed=0, max_sequence_length=cfg["prompt_len"] + cfg["response_len"])
    batch, mask = _workload(cfg)
    tree = mb.BranchTree.from_sequences(batch.sequences)
    adv = torch.linspace(-1, 1, tree.num_rollouts)
    tokens = mask.sum()

    def loss_fn(lp, ids):
        return losses.ppo_policy_loss(lp, lp.detach(), adv[ids], mask[ids], global_tokens=tokens)[0]

    step = dict(max_chunk_tokens=cfg["chunk_tokens"], recompute_stem=True, score_mask=mask)
    mb.replay_step(model, tree, loss_fn, **step)  # warm-up: gradients allocated before the measured step
    dist.barrier()
    start = time.perf_counter()
    mb.replay_step(model, tree, loss_fn, **step)
    dist.barrier()
    seconds = time.perf_counter() - start
    stats = mb.replay_step(model, tree, loss_fn, measure_memory=True, **step)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "peak_bytes": stats.peak_memory_bytes, "seconds": seconds,
                   "chunks": stats.num_chunks, "stems": stats.num_stems, "cache_bytes": stats.peak_cache_bytes}, f)
    destroy_distributed()


def predicted(cfg) -> List[float]:
    """The planner's peak for every rank of this run (same model, layout, chunk); ranks
    are laid out as Megatron's default order does (TP innermost, then CP)."""
    batch, mask = _workload(cfg)
    tree = mb.BranchTree.from_sequences(batch.sequences)
    spec = ModelSpec("bench-scale", MODEL["num_layers"], MODEL["hidden_size"], MODEL["num_attention_heads"],
                     MODEL["num_query_groups"], MODEL["ffn_hidden_size"], VOCAB)
    per_cp = replay_peak_bytes(spec, tree, chunk_tokens=cfg["chunk_tokens"], tp=cfg["tp"], cp=cfg["cp"],
                               score_mask=mask, act_bytes=4)
    return [per_cp[(r // cfg["tp"]) % cfg["cp"]] for r in range(cfg["tp"] * cfg["cp"])]


def run_bench_scale(cfg: Dict) -> Dict:
    """Measure and predict every rank's peak for ``cfg`` (:data:`SIZES`; checked first)."""
    check_layout(cfg)
    world = cfg["tp"] * cfg["cp"]
    with Progress(2, "bench-scale") as progress:
        pred = predicted(cfg)
        progress.update(f"model done; running {world} processes")
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(world, free_port(), cfg, tmp), nprocs=world, join=True)
            ranks = []
            for r in range(world):
                with open(os.path.join(tmp, f"rank{r}.json")) as f:
                    ranks.append(json.load(f))
        progress.update("measured")
    measured = [r["peak_bytes"] for r in ranks]
    return {
        "layout": {"tp": cfg["tp"], "cp": cfg["cp"], "chunk_tokens": cfg["chunk_tokens"], "recompute_stem": True},
        "workload": {k: cfg[k] for k in ("prompt_len", "rollouts", "response_len")},
        "model": {**MODEL, "vocab_size": VOCAB},
        "measured_peak_bytes": measured,
        "predicted_peak_bytes": pred,
        "error": [p / m - 1.0 for p, m in zip(pred, measured)],
        "seconds": max(r["seconds"] for r in ranks),
        "stems": ranks[0]["stems"],
        "chunks": ranks[0]["chunks"],
    }


def format_table(report: Dict) -> str:
    w, lay = report["workload"], report["layout"]
    lines = [f"workload: 1 prompt of {w['prompt_len']} + {w['rollouts']} x {w['response_len']} response tokens; "
             f"TP={lay['tp']} CP={lay['cp']}, chunk {lay['chunk_tokens']}, {report['stems']} stems, "
             f"{report['chunks']} chunks; step {report['seconds']:.1f} s on this machine",
             f"{'rank':>5s}{'measured MiB':>15s}{'model MiB':>12s}{'error':>9s}"]
    for r, (m, p, e) in enumerate(zip(report["measured_peak_bytes"], report["predicted_peak_bytes"],
                                      report["error"])):
        lines.append(f"{r:>5d}{m / 2**20:>15.1f}{p / 2**20:>12.1f}{100 * e:>+8.1f}%")
    worst = max(abs(e) for e in report["error"])
    lines.append(f"worst error {100 * worst:.1f}% ({'within' if worst <= 0.2 else 'OUTSIDE'} the 20% goal)")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--prompt-len", type=int, default=32768, help="prompt tokens; the headline workload has 131072")
    parser.add_argument("--rollouts", type=int, default=16, help="rollouts per prompt; the headline workload has 16")
    parser.add_argument("--response-len", type=int, default=768, help="response tokens; the headline workload has 3072")
    parser.add_argument("--cp", type=int, default=4, help="context-parallel processes")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel processes (sequence parallel)")
    parser.add_argument("--chunk-tokens", type=int, default=4096, help="streaming replay budget per forward")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")


def main(args) -> int:
    cfg = {k: getattr(args, k) for k in SIZES}
    report = run_bench_scale(cfg)  # the CLI's preflight has checked the layout (validate)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0
