"""FP8 across data-parallel ranks: every rank of the amax-reduction group runs the same units.

Transformer Engine reduces the FP8 scaling statistics (amax) over Megatron's amax-reduction
group after every forward under FP8; by default that group spans the data-parallel ranks
(``TransformerConfig.tp_only_amax_red=False``). Data-parallel ranks replay different
trees, which a token budget may cut into different numbers of units, and a rank that ran
fewer forwards would leave the others waiting in that reduction. Our own check (Megatron's
schedules run equal micro-batch counts by construction; ``replay_step`` does not).
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_branch._megatron import parallel_state
from megatron_branch.model import unwrap
from megatron_branch.replay.plan import ReplayOp


def check_fp8_plan(model, ops: Sequence[ReplayOp], *, recompute_stem: bool = False) -> None:
    """Raise unless every rank of the FP8 amax-reduction group runs the same sequence of
    forwards. Collective over that group when the model runs FP8 and the group has more
    than one rank (one small all-gather per step).

    Raises:
        ValueError: the ranks' plans differ: set ``tp_only_amax_red=True`` (amax reduced
            over tensor and context parallel ranks only, which run the same units), give
            every data-parallel rank trees with equal plans, or use one packed pass.
    """
    config = getattr(unwrap(model), "config", None)
    if not getattr(config, "fp8", None) or getattr(config, "tp_only_amax_red", False):
        return
    if not torch.distributed.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return
    group = parallel_state.get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=False)
    if group is None or group.size() == 1:
        return
    mine = (tuple(op.kind for op in ops), bool(recompute_stem))
    plans = [None] * group.size()
    torch.distributed.all_gather_object(plans, mine, group=group)
    if any(plan != mine for plan in plans):
        counts = sorted({sum(kind != "pop" for kind in plan[0]) for plan in plans})
        raise ValueError(
            f"tp_only_amax_red: under fp8 the ranks of the amax-reduction group (data x tensor x context parallel) "
            f"would run different numbers of forwards ({counts} units), and Transformer Engine's amax reduction "
            "after each forward would wait forever. Set TransformerConfig.tp_only_amax_red=True, or give every "
            "data-parallel rank trees with equal replay plans (max_chunk_tokens=None: one pass per tree)")
