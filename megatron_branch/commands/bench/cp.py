"""``megatron-branch bench-cp``: context-parallel branch replay on CPU processes.

For the long-prefix RL shape (one prompt, many short tails) and CP = 1, 2, 4 with both
K/V exchanges (all-gather, point-to-point), one run each: forward+backward time (median),
time relative to CP=1, per-rank tokens and attention work (visible (query, key) pairs)
and the max/mean balance, and the bytes each rank sent for attention per step. The
processes share this machine's cores, so times show the overhead of the split, not the
speed-up CP gives across real devices; the balance and byte counts carry over.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch.attention.context_parallel import comm_bytes, shard_bounds, shard_work
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.distributed import destroy_distributed, free_port, init_distributed
from megatron_branch.scoring.unit import linear_weight
from megatron_branch.spec.builders import build_gpt, llama_config

HEADS, QUERY_GROUPS = 4, 2  # the model's attention heads and key/value groups (its width is the shape's hidden)


def check_shape(cfg: dict, sizes) -> None:
    """Refuse a shape or CP sizes the spawned processes would fail on, before any starts.

    Args:
        cfg: the workload (``hidden``, ``prompt``, ``tails``, ``tail_len``, ``repeats``, ``threads``).
        sizes: the CP sizes to run, the first the baseline the others' times are relative to.

    Raises:
        ValueError: naming the field: a size below 1, no sizes or a first size other than 1,
            or ``hidden`` not a multiple of the model's attention heads (Megatron-Core's
            ``TransformerConfig`` asserts it). A CP size above the tree's tokens is fine: the
            ranks past them hold no token.
    """
    for name in ("hidden", "prompt", "tails", "tail_len", "repeats", "threads"):
        if cfg[name] < 1:
            raise ValueError(f"bench-cp shape: {name} must be >= 1, got {cfg[name]}")
    if not sizes or sizes[0] != 1 or min(sizes) < 1:
        raise ValueError(f"bench-cp sizes {tuple(sizes)}: CP sizes >= 1, starting with 1 (the baseline of 'vs CP=1')")
    if cfg["hidden"] % HEADS:
        raise ValueError(f"bench-cp shape: hidden {cfg['hidden']} is not a multiple of the model's {HEADS} heads")


def _worker(rank, world, port, cfg, comm, out_path):
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, cfg["threads"] // world))
    mb.enable_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    init_distributed(1, 1, world)
    config = llama_config(num_layers=2, hidden_size=cfg["hidden"], num_attention_heads=HEADS,
                          num_query_groups=QUERY_GROUPS, context_parallel_size=world)
    model = build_gpt(config, 256, seed=0)
    batch = branching_rollouts([cfg["prompt"]], [cfg["tails"]], [cfg["tail_len"]], 256, seed=0)
    tree = mb.BranchTree.from_sequences(batch.sequences)
    mask = losses.response_mask(batch.lengths, batch.prompt_lengths)
    adv = torch.linspace(-1, 1, tree.num_rollouts)
    tokens = mask.sum()

    def loss_fn(lp, ids):
        return losses.ppo_policy_loss(lp, lp.detach(), adv[ids], mask[ids], global_tokens=tokens)[0]

    mb.replay_step(model, tree, loss_fn, cp_comm_type=comm)  # warm-up
    comm_bytes(reset=True)
    times = []
    for _ in range(cfg["repeats"]):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        mb.replay_step(model, tree, loss_fn, cp_comm_type=comm)
        dist.barrier()
        times.append(time.perf_counter() - start)
    sent = comm_bytes() / cfg["repeats"]
    bounds = shard_bounds(tree.positions, world, linear_weight(config))  # the split replay used
    work = shard_work(tree.positions, bounds)
    gathered = [None] * world
    dist.all_gather_object(gathered, sent)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"cp": world, "comm": comm, "seconds": statistics.median(times),
                       "bytes_sent_per_rank": gathered, **work}, f)
    destroy_distributed()


def run_bench_cp(quick: bool, sizes=(1, 2, 4), echo=print, shape=None) -> dict:
    """Run every CP size and exchange; ``shape`` overrides the workload (tests)."""
    cfg = dict(hidden=64, prompt=1024, tails=16, tail_len=64, repeats=2, threads=torch.get_num_threads()) if quick \
        else dict(hidden=128, prompt=4096, tails=16, tail_len=256, repeats=3, threads=torch.get_num_threads())
    cfg.update(shape or {})
    check_shape(cfg, sizes)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in sizes:
            for comm in (("allgather",) if cp == 1 else ("allgather", "p2p")):
                echo(f"bench-cp: CP={cp} {comm} ...")
                path = os.path.join(tmp, f"{cp}-{comm}.json")
                mp.spawn(_worker, args=(cp, free_port(), cfg, comm, path), nprocs=cp, join=True)
                with open(path) as f:
                    rows.append(json.load(f))
    base = rows[0]["seconds"]
    for r in rows:
        pairs = r["attention_pairs"]
        r["time_vs_cp1"] = r["seconds"] / base
        r["max_over_mean_attention"] = max(pairs) / (sum(pairs) / len(pairs))
    return {"shape": cfg, "rows": rows}


def format_table(report: dict) -> str:
    s = report["shape"]
    lines = [f"long-prefix shape: prompt {s['prompt']} + {s['tails']} tails x {s['tail_len']}, hidden {s['hidden']}",
             f"{'CP':>3s} {'comm':<10s}{'seconds':>9s}{'vs CP=1':>9s}{'max/mean attn':>15s}"
             f"{'tokens per rank':>24s}{'MB sent/rank/step':>19s}"]
    for r in report["rows"]:
        toks = ",".join(str(int(t)) for t in r["tokens"])
        mb_sent = max(r["bytes_sent_per_rank"]) / 2**20
        lines.append(f"{r['cp']:>3d} {r['comm']:<10s}{r['seconds']:>9.3f}{r['time_vs_cp1']:>8.2f}x"
                     f"{r['max_over_mean_attention']:>15.3f}{toks:>24s}{mb_sent:>19.2f}")
    return "\n".join(lines)


def main(args) -> int:
    report = run_bench_cp(args.quick)
    print(format_table(report))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_cp.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="a smaller shape (about a minute)")
    parser.add_argument("--out", default="bench_out", help="directory for bench_cp.json")
