"""Branch replay on Megatron's training machinery: DDP, optimizers, schedules, finalisation.

    model = wrap_ddp(gpt_model, overlap_grad_reduce=True, use_distributed_optimizer=True)
    optimizer = get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-6, bf16=..., ...), [model])
    plan = plan_data_parallel(rollouts, group_ids, dp_size, micro_batch_tokens=16384)
    train_step([model], optimizer, plan.ranks[dp_rank], loss_fn)   # loss_fn -> (sum, count)

Files: :mod:`.ddp` (Megatron DDP wrapping), :mod:`.optimizer` (``get_megatron_optimizer``
on CPU too), :mod:`.batching` (whole-tree DP balance and micro-batches), :mod:`.schedule`
(packed trees in Megatron's pipeline schedules), :mod:`.step` (one iteration),
:mod:`.finite_guard` (NaN/Inf detection), :mod:`.checkpoint` (save/resume through
Megatron's ``dist_checkpointing``, atomic).
"""

from megatron_branch.model import GradSync, as_chunks, check_wrapper, param_grad
from megatron_branch.training.batching import DataParallelPlan, TreeMicroBatch, plan_data_parallel
from megatron_branch.training.checkpoint import (
    LoadedCheckpoint,
    check_load_dir,
    check_save_dir,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
)
from megatron_branch.training.ddp import wrap_ddp, zero_grads
from megatron_branch.training.optimizer import get_optimizer, optimizer_step
from megatron_branch.training.runtime_check import ExactnessCheck, ExactnessError
from megatron_branch.training.step import StepResult, configure, forward_backward_step, train_step

__all__ = [
    "DataParallelPlan",
    "ExactnessCheck",
    "ExactnessError",
    "GradSync",
    "LoadedCheckpoint",
    "StepResult",
    "TreeMicroBatch",
    "as_chunks",
    "check_load_dir",
    "check_save_dir",
    "check_wrapper",
    "configure",
    "forward_backward_step",
    "get_optimizer",
    "latest_iteration",
    "load_checkpoint",
    "optimizer_step",
    "param_grad",
    "plan_data_parallel",
    "save_checkpoint",
    "train_step",
    "wrap_ddp",
    "zero_grads",
]
