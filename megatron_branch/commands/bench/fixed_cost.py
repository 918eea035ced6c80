"""The stock stack's fixed cost per pass, and the speed-ups it leaves (``megatron-branch bench``).

Every forward+backward through Megatron's GPTModel pays a cost that does not shrink with
the work: module calls, op dispatch, autograd bookkeeping, the loss's all-reduce. On the
CPU it is serial, so a second thread does not halve it, and on short steps it is a large
part of the time. ``S`` is the stock naive step on one two-token rollout, where everything
else is negligible; it is timed in every repeat, side by side with the methods.

The naive reference with ``k`` micro-batches pays ``k * S``; a tree method running the same
stack pays at least ``S`` once, however little work it has. A method whose work is exactly
``1 / ideal`` of naive's (the ideal FLOP ratio) and whose fixed cost is the stock stack's
would take ``S + (T_naive - k * S) / ideal``, so its speed-up is at most::

    bound = T_naive / (S + (T_naive - k * S) / ideal)

``fraction_of_bound`` = speed-up / bound separates the cost both sides pay in Megatron's
stack from ours' own excess (planner, merges, scoring). Streaming with ``u`` units (chunks
and stems, each a pass through the stack) pays ``(u - 1) * S`` more than one pass, so its
speed against one pass is at most ``T_ours / (T_ours + (u - 1) * S)``. What a unit
really adds is reported beside it: ``seconds_per_unit`` ((streaming - one pass) / (u - 1))
and ours' own one pass on the same two-token rollout (``fixed_cost_ours_seconds``).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List

import torch

from megatron_branch.commands.bench.methods import prepare_methods
from megatron_branch.commands.bench.stats import spread
from megatron_branch.commands.synthetic import branching_rollouts

CALLS_PER_REPEAT = 3  # S per repeat: the median of this many back-to-back steps


def fixed_cost_step(models: Dict[str, torch.nn.Module], vocab: int, loss_for,
                    method: str = "naive") -> Callable[[], None]:
    """A step on one rollout of two tokens: the stock naive step (``naive_mb1``, ``S``), or
    with ``method="ours"`` branch replay's one pass (the stack plus the tree build, plan
    and scoring around it: what every streaming unit pays again).

    Args:
        models: the bench's ``{"cascade", ...}`` models.
        vocab: their vocabulary size.
        loss_for: ``batch -> loss_fn`` (the bench's GRPO-style loss).
        method: ``"naive"`` or ``"ours"``.
    """
    batch = branching_rollouts([1], [1], [1], vocab, seed=0)
    (step,) = prepare_methods(models, batch, loss_for(batch), 1 << 30, [method])
    return step.step


def time_fixed_cost(step: Callable[[], None], zero: Callable[[], None]) -> float:
    """One repeat's ``S``: the median of :data:`CALLS_PER_REPEAT` timed steps."""
    times = []
    for _ in range(CALLS_PER_REPEAT):
        zero()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def speedup_bound(t_naive: float, fixed: float, micro_batches: int, ideal: float) -> float:
    """The speed-up of a method with ``1 / ideal`` of naive's work and the stack's fixed cost once."""
    if ideal <= 0 or t_naive <= 0:
        raise ValueError(f"speedup_bound: ideal ({ideal}) and t_naive ({t_naive}) must be > 0")
    variable = max(t_naive - micro_batches * fixed, 0.0)
    return t_naive / (fixed + variable / ideal)


def one_pass_bound(t_one: float, fixed: float, units: int) -> float:
    """Streaming's speed against one pass when each of its ``units`` pays the fixed cost."""
    return t_one / (t_one + max(units - 1, 0) * fixed)


def add_bounds(rows: List[dict], reference: str, num_rollouts: int, ideal: float,
               times: Dict[str, List[float]], fixed: List[float]) -> None:
    """Adds ``fixed_cost_bound`` and ``fraction_of_bound`` to ours' row, and
    ``one_pass_bound`` / ``fraction_of_one_pass_bound`` to the streaming rows, paired per
    repeat (``fixed[i]`` is repeat ``i``'s ``S``)."""
    if not reference or "ours" not in times:
        return
    per_batch = int(reference.replace("naive_mb", ""))
    k = -(-num_rollouts // per_batch)
    naive, one = times[reference], times["ours"]
    for row in rows:
        name = row["method"]
        if name == "ours":
            bounds = [speedup_bound(n, s, k, ideal) for n, s in zip(naive, fixed)]
            row["fixed_cost_bound"] = spread(bounds)
            row["fraction_of_bound"] = spread([(n / o) / b for n, o, b in zip(naive, one, bounds)])
        elif "chunks" in row and name in times:
            units = row["chunks"] + row["stems"]
            bounds = [one_pass_bound(o, s, units) for o, s in zip(one, fixed)]
            row["one_pass_bound"] = spread(bounds)
            row["fraction_of_one_pass_bound"] = spread(
                [(o / t) / b for o, t, b in zip(one, times[name], bounds)])
