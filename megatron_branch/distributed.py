"""Process-group set-up for single- and multi-process runs (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from megatron_branch._megatron import parallel_state


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    backend: str | None = None,
) -> None:
    """Initialise ``torch.distributed`` (from torchrun's env, or a 1-process group) and
    Megatron's ``parallel_state``. Idempotent for the same sizes.

    Raises:
        ValueError: the parallel sizes do not divide the world size.
    """
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:  # one process: an in-memory store, no port to collide on
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world % model_parallel:
        raise ValueError(
            f"tensor/pipeline/context parallel sizes {tensor_model_parallel_size}x"
            f"{pipeline_model_parallel_size}x{context_parallel_size} do not divide world size {world}"
        )
    if parallel_state.model_parallel_is_initialized():
        same = (
            parallel_state.get_tensor_model_parallel_world_size() == tensor_model_parallel_size
            and parallel_state.get_pipeline_model_parallel_world_size() == pipeline_model_parallel_size
            and parallel_state.get_context_parallel_world_size() == context_parallel_size
        )
        if same:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
    )


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
