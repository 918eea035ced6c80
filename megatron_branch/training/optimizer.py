"""Megatron's optimizers (``get_megatron_optimizer``) for branch-replay training.

The optimizer classes are Megatron's own: ``FP32Optimizer``,
``Float16OptimizerWithFloat16Params`` (bf16 parameters, fp32 main parameters) and
``DistributedOptimizer`` (optimizer state sharded over data-parallel ranks). On a machine
without CUDA their constructors and ``step`` allocate with a literal ``device="cuda"``
and check ``param.type()`` against CUDA type names; both run inside
:func:`megatron_branch.cpu.cuda_factories_on_cpu`, which is a no-op where CUDA exists.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from megatron_branch._megatron import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron_branch.cpu import cuda_factories_on_cpu
from megatron_branch.model import as_chunks, is_megatron_ddp


def get_optimizer(config: OptimizerConfig, model: Sequence[torch.nn.Module]) -> MegatronOptimizer:
    """``get_megatron_optimizer(config, model_chunks)``, runnable on CPU.

    Raises:
        ValueError: a model chunk is not wrapped in Megatron's DDP (the optimizers read
            ``main_grad`` and, with ``use_distributed_optimizer``, DDP's buffers).
    """
    chunks = as_chunks(model)
    for chunk in chunks:
        if not is_megatron_ddp(chunk):
            raise ValueError(
                "model: Megatron's optimizers need chunks wrapped in "
                "megatron.core.distributed.DistributedDataParallel (megatron_branch.training.wrap_ddp)"
            )
        if chunk.ddp_config.use_distributed_optimizer != config.use_distributed_optimizer:
            raise ValueError(
                "use_distributed_optimizer: the OptimizerConfig and the DDP config disagree "
                f"({config.use_distributed_optimizer} vs {chunk.ddp_config.use_distributed_optimizer})"
            )
    with cuda_factories_on_cpu():
        return get_megatron_optimizer(config, chunks)


def check_optimizer(optimizer) -> MegatronOptimizer:
    """Raise ``ValueError`` unless ``optimizer`` is one of Megatron's."""
    if not isinstance(optimizer, MegatronOptimizer):
        raise ValueError(
            f"optimizer: {type(optimizer).__name__} is not a Megatron optimizer; build it with "
            "megatron_branch.training.get_optimizer (megatron.core.optimizer.get_megatron_optimizer)"
        )
    return optimizer


def optimizer_step(optimizer: MegatronOptimizer) -> Tuple[bool, float, int]:
    """``optimizer.step()`` (runnable on CPU): ``(update_successful, grad_norm, num_zeros)``."""
    check_optimizer(optimizer)
    with cuda_factories_on_cpu():
        return optimizer.step()
