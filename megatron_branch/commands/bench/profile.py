"""Where branch replay's remaining gap to the ideal ratio goes (``megatron-branch bench``).

For one shape, the fastest naive micro-batching and ``ours`` each run once more under
``torch.profiler`` (CPU). Every ATen op's *self* time is put in a category by its name;
what the ops do not account for of the wall time is Python and dispatch overhead (module
calls, autograd bookkeeping, the replay planner). A perfectly efficient tree method would
spend ``naive / ideal_ratio`` in every category; the *excess* of ours over that, per
category, is where the gap goes. The ideal FLOP ratio prices attention at the GEMMs' rate;
each category is also given at naive's own cost per unit of work (its attention time per
visible pair, the rest per position, applied to ours' pairs and positions), which is what a
tree method running every kernel exactly as efficiently as naive would take. Both runs are
profiled, so the profiler's own overhead lands mostly in the overhead row of both.
The profiler's own output (Kineto's lines on the process's stderr, its Python warnings) is
silenced unless ``verbose`` (``megatron-branch bench --verbose``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from typing import Dict, Iterator, List

ATTENTION = "attention kernel"
CATEGORIES = (
    (ATTENTION, ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("GEMMs (linear layers, logits)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
                                       "aten::linear", "aten::_addmm_activation")),
    ("logits / cross-entropy / softmax", ("softmax", "nll_loss", "logsumexp", "cross_entropy", "aten::exp",
                                          "aten::log", "aten::max", "aten::amax", "aten::sum")),
    ("gathers / index / copies", ("index", "gather", "scatter", "aten::cat", "aten::stack", "copy", "clone",
                                  "contiguous", "embedding", "masked", "aten::where", "repeat", "pad",
                                  "aten::zeros", "aten::empty", "fill_", "narrow", "aten::split", "aten::take")),
)
OTHER = "other ATen (norms, activations, elementwise)"
OVERHEAD = "Python / dispatch overhead (wall - op time)"


def _category(name: str) -> str:
    for label, keys in CATEGORIES:
        if any(k in name for k in keys):
            return label
    return OTHER


@contextlib.contextmanager
def _quiet(verbose: bool) -> Iterator[None]:
    """Silence torch.profiler unless ``verbose``: Kineto writes "USDT: ... profiler_start" and
    "STAGE: ..." lines straight to file descriptor 2 from C++ (no log level turns the USDT ones
    off), so Python's ``sys.stderr`` cannot catch them; descriptors 1 and 2 go to /dev/null
    for the profiled run and its post-processing only, and Python warnings are ignored there."""
    if verbose:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sys.stdout.flush(), sys.stderr.flush()
        try:
            saved = [os.dup(fd) for fd in (1, 2)]
        except OSError:  # no descriptors to redirect (a closed or embedded stdio)
            saved = None
        if saved is None:
            yield
            return
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            for fd in (1, 2):
                os.dup2(null, fd)
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
            os.close(null)


def _profile(step, zero, verbose: bool = False) -> Dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    zero()
    step()  # warm
    zero()
    with _quiet(verbose):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            step()
            wall = time.perf_counter() - start
        events = prof.key_averages()
    out = {label: 0.0 for label, _ in CATEGORIES}
    out[OTHER] = 0.0
    for ev in events:
        if not ev.key.startswith("aten::"):
            continue  # autograd nodes and record_function ranges: their children are counted
        out[_category(ev.key)] += ev.self_cpu_time_total / 1e6
    out[OVERHEAD] = max(wall - sum(out.values()), 0.0)
    out["wall"] = wall
    return out


def profile_gap(shape_name: str, summary: dict, models, batch, loss_fn, prepared, verbose: bool = False) -> dict:
    """The per-category breakdown of ``ours`` vs the fastest naive scaled by the ideal ratio
    (``verbose``: with the profiler's own output)."""
    by_name = {p.name: p for p in prepared}
    ref = summary["naive_reference"]
    ideal = summary["ideal_flop_ratio"]

    def zero():
        for m in models.values():
            m.zero_grad(set_to_none=True)

    naive = _profile(by_name[ref].step, zero, verbose)
    ours = _profile(by_name["ours"].step, zero, verbose)
    gap = ours["wall"] - naive["wall"] / ideal
    # naive's own cost per unit of work: its attention per (query, key) pair, the rest per
    # position (the reference's padded counts), applied to ours' work
    work_ratio = {"pairs": by_name[ref].attention_pairs / by_name["ours"].attention_pairs,
                  "positions": by_name[ref].positions / by_name["ours"].positions}
    rows: List[dict] = []
    for label in [c for c, _ in CATEGORIES] + [OTHER, OVERHEAD]:
        target = naive[label] / ideal
        at_rate = naive[label] / work_ratio["pairs" if label == ATTENTION else "positions"]
        rows.append({"category": label, "naive_seconds": naive[label], "naive_over_ideal_seconds": target,
                     "naive_rate_seconds": at_rate,
                     "ours_seconds": ours[label], "excess_seconds": ours[label] - target,
                     "share_of_gap": (ours[label] - target) / gap if gap > 0 else None})
    at_rate_total = sum(r["naive_rate_seconds"] for r in rows)
    return {"shape": shape_name, "naive_reference": ref, "ideal_flop_ratio": ideal,
            "naive_wall_seconds": naive["wall"], "ours_wall_seconds": ours["wall"],
            "ideal_ours_seconds": naive["wall"] / ideal, "gap_seconds": gap,
            "fraction_of_ideal_profiled": naive["wall"] / ours["wall"] / ideal,
            "work_ratios": work_ratio, "naive_rate_ours_seconds": at_rate_total,
            "fraction_of_naive_rate_profiled": at_rate_total / ours["wall"], "rows": rows}


def format_profile(profiles: List[dict]) -> str:
    lines = ["\nwhere ours' gap to the ideal ratio goes (torch.profiler, one profiled run each; seconds):"]
    for p in profiles:
        lines.append(f"\n{p['shape']}: naive ({p['naive_reference']}) {p['naive_wall_seconds']:.3f}s, ideal ours "
                     f"{p['ideal_ours_seconds']:.3f}s, ours {p['ours_wall_seconds']:.3f}s, gap "
                     f"{p['gap_seconds']:+.3f}s ({100 * p['fraction_of_ideal_profiled']:.0f}% of ideal under the "
                     f"profiler)")
        w = p["work_ratios"]
        lines.append(f"  at naive's own cost per unit of work (attention per pair, {w['pairs']:.2f}x fewer; the rest "
                     f"per position, {w['positions']:.2f}x fewer) ours would take {p['naive_rate_ours_seconds']:.3f}s: "
                     f"ours is at {100 * p['fraction_of_naive_rate_profiled']:.0f}% of that")
        lines.append(f"{'category':<46s}{'naive':>9s}{'naive/ideal':>12s}{'at rate':>9s}{'ours':>9s}{'excess':>9s}"
                     f"{'of gap':>8s}")
        for r in p["rows"]:
            share = f"{100 * r['share_of_gap']:.0f}%" if r["share_of_gap"] is not None else "-"
            lines.append(f"{r['category']:<46s}{r['naive_seconds']:>9.3f}{r['naive_over_ideal_seconds']:>12.3f}"
                         f"{r['naive_rate_seconds']:>9.3f}{r['ours_seconds']:>9.3f}{r['excess_seconds']:>+9.3f}"
                         f"{share:>8s}")
    return "\n".join(lines)
