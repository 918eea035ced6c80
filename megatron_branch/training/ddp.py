"""Megatron's ``DistributedDataParallel`` around branch-replay models.

Megatron DDP keeps every gradient in a contiguous ``main_grad`` buffer and reduces it per
bucket, either after the step's backward (``finish_grad_sync``) or, with
``overlap_grad_reduce=True``, as soon as every parameter of a bucket has reported its
gradient in the *last micro-batch* (the one not run under ``no_sync``). Branch replay may
run several backwards for one micro-batch (one per streaming chunk, one per stem); the
helpers here hold the reduction for all but the final one, so each bucket is reduced once
per step, after its last contribution.

Megatron's wrappers are used as they are; this module only chooses settings, accepts the
list-of-chunks convention and refuses wrappers that would reduce gradients per backward
(torch's DDP/FSDP).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Union

import torch

from megatron_branch._megatron import DistributedDataParallel, DistributedDataParallelConfig, Float16Module

Chunks = Union[torch.nn.Module, Sequence[torch.nn.Module]]


def as_chunks(model: Chunks) -> List[torch.nn.Module]:
    """``model`` as Megatron's list of model chunks (a module becomes ``[module]``)."""
    if isinstance(model, (list, tuple)):
        if not model:
            raise ValueError("model: an empty list of model chunks")
        return list(model)
    return [model]


def single_chunk(model: Chunks, what: str) -> torch.nn.Module:
    """The one model chunk of ``model``; virtual-pipeline chunk lists belong to the schedules."""
    chunks = as_chunks(model)
    if len(chunks) != 1:
        raise ValueError(
            f"model: {what} takes one model chunk, got {len(chunks)} (virtual pipeline stages run "
            f"through megatron_branch.training.schedule.forward_backward)"
        )
    check_wrapper(chunks[0])
    return chunks[0]


def check_wrapper(model: torch.nn.Module) -> None:
    """Refuse wrappers whose gradient reduction branch replay cannot control.

    torch's ``DistributedDataParallel`` all-reduces after *every* backward and FSDP shards
    parameters outside Megatron's buffers; replay runs several backwards per step, so both
    would reduce partial gradients. Megatron's DDP is the supported wrapper.
    """
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    m = model
    while m is not None:
        if isinstance(m, TorchDDP):
            raise ValueError(
                "model: torch.nn.parallel.DistributedDataParallel reduces gradients after every "
                "backward; wrap the model in megatron.core.distributed.DistributedDataParallel "
                "(megatron_branch.training.wrap_ddp) instead"
            )
        kind = type(m).__name__
        if kind in ("FullyShardedDataParallel", "FSDPModule") or kind.startswith("FSDP"):
            raise ValueError(
                f"model: {kind} (torch FSDP) is not supported by branch replay; wrap the model in "
                "megatron.core.distributed.DistributedDataParallel (megatron_branch.training.wrap_ddp)"
            )
        m = getattr(m, "module", None)


def is_megatron_ddp(model: torch.nn.Module) -> bool:
    return isinstance(model, DistributedDataParallel)


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


def param_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The accumulated gradient of ``p``: Megatron DDP's ``main_grad`` or torch's ``.grad``."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def _bucket_groups(model: Chunks):
    for chunk in as_chunks(model):
        if is_megatron_ddp(chunk):
            yield from chunk.bucket_groups + chunk.expert_parallel_bucket_groups


def sync_enabled(model: Chunks) -> bool:
    """False inside ``no_sync()`` (a micro-batch that is not the step's last)."""
    return all(bg.is_last_microbatch for bg in _bucket_groups(model))


class GradSync:
    """Controls Megatron DDP's reduction over the several backwards of one replay.

    ``hold()`` wraps every backward but the final one of the micro-batch; the final one
    runs as the caller left it (reducing if this is the step's last micro-batch, held if
    the caller is inside ``no_sync()``). A no-op for unwrapped models.
    """

    def __init__(self, model: Chunks):
        self.chunks = [c for c in as_chunks(model) if is_megatron_ddp(c)]
        self.active = bool(self.chunks) and sync_enabled(self.chunks)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        if not self.active:
            yield
            return
        with contextlib.ExitStack() as stack:
            for chunk in self.chunks:
                stack.enter_context(chunk.no_sync())
            yield


def zero_grads(model: Chunks) -> None:
    """Zero gradients the way the wrapper expects (``zero_grad_buffer`` for Megatron DDP)."""
    for chunk in as_chunks(model):
        if is_megatron_ddp(chunk):
            chunk.zero_grad_buffer()
        else:
            chunk.zero_grad(set_to_none=True)
