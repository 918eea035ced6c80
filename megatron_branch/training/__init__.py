"""Branch replay on Megatron's training machinery: DDP, optimizers, schedules, finalisation.

    model = wrap_ddp(gpt_model, overlap_grad_reduce=True, use_distributed_optimizer=True)
    optimizer = get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-6, bf16=..., ...), [model])
    plan = plan_data_parallel(rollouts, group_ids, dp_size, micro_batch_tokens=16384)
    train_step([model], optimizer, plan.ranks[dp_rank], loss_fn)   # loss_fn -> (sum, count)

Files: :mod:`.ddp` (Megatron DDP wrapping, held reduction over replay's backwards),
:mod:`.optimizer` (``get_megatron_optimizer`` on CPU too), :mod:`.batching` (whole-tree
DP balance and micro-batches), :mod:`.step` (one iteration), :mod:`.checkpoint`
(save/resume through Megatron's ``dist_checkpointing``, atomic). Names are imported on first
use (the replay and pipeline modules import :mod:`.ddp` and :mod:`.batching` directly).
"""

import importlib
from typing import Any

_EXPORTS = {
    "LoadedCheckpoint": "checkpoint",
    "check_load_dir": "checkpoint",
    "check_save_dir": "checkpoint",
    "latest_iteration": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "DataParallelPlan": "batching",
    "TreeMicroBatch": "batching",
    "plan_data_parallel": "batching",
    "GradSync": "ddp",
    "as_chunks": "ddp",
    "check_wrapper": "ddp",
    "param_grad": "ddp",
    "wrap_ddp": "ddp",
    "get_optimizer": "optimizer",
    "optimizer_step": "optimizer",
    "StepResult": "step",
    "configure": "step",
    "forward_backward_step": "step",
    "train_step": "step",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_branch.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"megatron_branch.training.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_EXPORTS)
