"""Megatron's ``DistributedDataParallel`` around branch-replay models.

Megatron DDP keeps every gradient in a contiguous ``main_grad`` buffer and reduces it per
bucket. Megatron's wrappers are used as they are; this module only chooses settings.
Holding the reduction over replay's several backwards is
:class:`megatron_branch.model.GradSync`; refusing wrappers that would reduce per backward
(torch's DDP/FSDP) is :func:`megatron_branch.model.check_wrapper`.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_branch._megatron import DistributedDataParallel, DistributedDataParallelConfig, Float16Module
from megatron_branch.model import Chunks, as_chunks, check_wrapper, is_megatron_ddp


def wrap_ddp(
    model: torch.nn.Module,
    *,
    bf16: bool = False,
    grad_reduce_in_fp32: bool = True,
    overlap_grad_reduce: bool = False,
    use_distributed_optimizer: bool = False,
    bucket_size: Optional[int] = None,
    **ddp_config,
) -> DistributedDataParallel:
    """Wrap a model chunk as Megatron-LM's ``get_model`` does: ``Float16Module`` (bf16) then
    Megatron's ``DistributedDataParallel``.

    Args:
        model: a GPTModel (fp32 parameters).
        bf16: run the model in bf16 (``Float16Module``; the config must have ``bf16=True``).
        grad_reduce_in_fp32, overlap_grad_reduce, use_distributed_optimizer, bucket_size,
            **ddp_config: fields of ``DistributedDataParallelConfig``.

    Returns:
        The wrapped chunk; gradients accumulate in ``param.main_grad``.
    """
    check_wrapper(model)
    config = model.config
    if bf16:
        if not config.bf16:
            raise ValueError("bf16: the model's TransformerConfig needs bf16=True")
        model = Float16Module(config, model)
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
        **ddp_config,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp, module=model)


def zero_grads(model: Chunks) -> None:
    """Zero gradients the way the wrapper expects (``zero_grad_buffer`` for Megatron DDP)."""
    for chunk in as_chunks(model):
        if is_megatron_ddp(chunk):
            chunk.zero_grad_buffer()
        else:
            chunk.zero_grad(set_to_none=True)
