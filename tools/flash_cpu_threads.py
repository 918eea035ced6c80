"""torch's CPU flash kernel on pieces of few keys, on one thread and on several.

    python tools/flash_cpu_threads.py                       # the kernel table, ~1 minute on 2 cores
    python tools/flash_cpu_threads.py --step agentic        # also the bench's forest step, gate on/off (~1 min)

``megatron_branch.attention.kernels`` runs a ``flash_cpu`` call on pieces of fewer than
``FLASH_CPU_SERIAL_KEYS`` keys on one intra-op thread. This prints the measurement behind
that choice, side by side in one process (interleaved rounds, medians):

* the kernel table: forward and backward of batches of equal causal pieces (4 query
  heads, 2 K/V heads of 32, as the bench's hidden-128 model), on one thread and on
  ``--threads``, and the ratio; ``gate`` says which the kernel wrapper uses;
* ``--step SHAPE``: the bench's step of ours (one pass) on that bench shape (hidden 128,
  the bench's models and loss) with the gate on and off (``FLASH_CPU_SERIAL_KEYS = 0``),
  paired per round.

The values are bitwise the same either way (``tests/test_attention.py``); only time moves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

from megatron_branch.attention import kernels
from megatron_branch.commands.bench import allocator
from megatron_branch.commands.bench import run as bench
from megatron_branch.commands.bench.methods import prepare_methods
from megatron_branch.cpu import enable_cpu
from megatron_branch.distributed import init_distributed

# (pieces, queries, keys): the agentic forest's batches (16-token turns) and wider ones
SHAPES: List[Tuple[int, int, int]] = [(250, 16, 16), (64, 80, 16), (500, 8, 8), (125, 32, 32), (64, 48, 48),
                                      (64, 64, 64), (8, 256, 64), (1, 1471, 128)]


def _medians(steps: Dict[str, Callable[[], None]], rounds: int) -> Dict[str, float]:
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _on_threads(threads: int, fn: Callable[[], object]) -> Callable[[], None]:
    def run():
        with kernels.intra_op_threads(threads):
            fn()
    return run


def kernel_table(threads: int, rounds: int) -> List[str]:
    """Markdown rows: the raw kernel on one thread and on ``threads``, forward and backward."""
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    rows = [f"| pieces x queries x keys | forward ms, 1 / {threads} threads | backward ms, 1 / {threads} threads "
            f"| {threads} threads / 1 (fwd, bwd) | gate |", "|---|---|---|---|---|"]
    gen = torch.Generator().manual_seed(0)
    for b, nq, nk in SHAPES:
        # [B, heads, n, 32] views of [B, n, heads, 32], as the cascade passes them
        q, k, v = (torch.randn(b, n, h, 32, generator=gen).transpose(1, 2) for n, h in ((nq, 4), (nk, 2), (nk, 2)))
        out, lse = fwd(q, k, v, 0.0, True, scale=32 ** -0.5)
        dout = torch.randn(out.shape, generator=gen)
        f = lambda: fwd(q, k, v, 0.0, True, scale=32 ** -0.5)  # noqa: E731
        g = lambda: bwd(dout, q, k, v, out, lse, 0.0, True, scale=32 ** -0.5)  # noqa: E731
        t = _medians({"f1": _on_threads(1, f), "fn": _on_threads(threads, f),
                      "b1": _on_threads(1, g), "bn": _on_threads(threads, g)}, rounds)
        gate = "1 thread" if nk < kernels.FLASH_CPU_SERIAL_KEYS else f"{threads} threads"
        rows.append(f"| {b} x {nq} x {nk} | {1e3 * t['f1']:.2f} / {1e3 * t['fn']:.2f} | "
                    f"{1e3 * t['b1']:.2f} / {1e3 * t['bn']:.2f} | {t['fn'] / t['f1']:.2f}x, {t['bn'] / t['b1']:.2f}x "
                    f"| {gate} |")
    return rows


def step_ab(shape_name: str, threads: int, rounds: int) -> List[str]:
    """Ours' one-pass step on a bench shape with the gate on and off, paired per round."""
    enable_cpu()
    init_distributed()
    allocator.apply(allocator.KEEP)
    cfg = bench.BenchConfig.full()
    shape = _one_shape(shape_name)
    models = bench._models(cfg, shape.moe, shape.hybrid)
    batch = shape.batch(cfg.vocab_size, cfg.seed)
    methods = {p.name: p for p in prepare_methods(models, batch, bench._loss(batch), cfg.chunk_tokens, ["ours"])}
    gate = kernels.FLASH_CPU_SERIAL_KEYS
    times: Dict[str, List[float]] = {"on": [], "off": []}
    try:
        with kernels.intra_op_threads(threads):
            for keys in (gate, 0):
                kernels.FLASH_CPU_SERIAL_KEYS = keys
                methods["ours"].step()  # warm
            for _ in range(rounds):
                for name, keys in (("on", gate), ("off", 0)):
                    kernels.FLASH_CPU_SERIAL_KEYS = keys
                    bench._zero(models)
                    start = time.perf_counter()
                    methods["ours"].step()
                    times[name].append(time.perf_counter() - start)
    finally:
        kernels.FLASH_CPU_SERIAL_KEYS = gate
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    paired = statistics.median([a / b for a, b in zip(times["off"], times["on"])])
    return [f"{shape.name}, hidden {cfg.hidden_size}, {threads} threads, ours' one pass over {rounds} paired rounds: "
            f"gate on {1e3 * on:.1f} ms, off {1e3 * off:.1f} ms; off / on {paired:.3f}x (paired median)"]


def _one_shape(name: str):
    """The one bench shape ``name`` selects (``ValueError`` naming the shapes otherwise)."""
    shapes = bench.select_shapes(bench.BenchConfig.full().shapes, [name])
    if len(shapes) != 1:
        raise ValueError(f"--step: {name!r} matches {len(shapes)} shapes ({[s.name for s in shapes]}); name one")
    return shapes[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--threads", type=int, default=2, help="the thread count compared with one (default 2)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per kernel shape (median)")
    parser.add_argument("--step", default=None, metavar="SHAPE",
                        help="also time ours' step on this bench shape with the gate on and off (e.g. agentic)")
    parser.add_argument("--step-rounds", type=int, default=7, help="paired rounds of --step")
    args = parser.parse_args(argv)
    for flag in ("threads", "rounds", "step_rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
    if args.step:
        try:
            _one_shape(args.step)
        except ValueError as err:
            parser.error(str(err).replace("--shapes", "--step"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} default threads")
    print("\n".join(kernel_table(args.threads, args.rounds)))
    if args.step:
        print("\n".join(step_ab(args.step, args.threads, args.step_rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
