"""Full (unsharded) weights and gradients across TP and PP, under stock Megatron names.

:func:`full_state` / :func:`load_full_state` join TP shards and renumber pipeline
stages' layers globally, identical whatever the layout; used by the example's
``--dump-grads``/``--dump-params`` and to start parallel runs from one set of weights.
Gradients are read from Megatron DDP's ``main_grad`` when the model is wrapped (after
``finalize_model_grads`` every rank holds the reduced gradient of its shard).
Gradient reduction itself is Megatron's ``finalize_model_grads``
(:mod:`megatron_branch.training`).
"""

from __future__ import annotations

import re
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_branch._megatron import parallel_state
from megatron_branch.scoring.vocab import unwrap
from megatron_branch.training.ddp import param_grad

_LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)(\..*)$")


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _global_name(model, name: str) -> str:
    """``decoder.layers.{local}.`` -> ``decoder.layers.{global}.`` (pipeline stages)."""
    m = _LAYER.match(name)
    if not m:
        return name
    layer = unwrap(model).decoder.layers[int(m.group(2))]
    return f"{m.group(1)}{layer.layer_number - 1}{m.group(3)}"


_EMBEDDING = "embedding.word_embeddings.weight"


def _tied_copy(name: str, param) -> bool:
    """The last pipeline stage's copy of tied word embeddings (Megatron keeps it equal to
    the first stage's ``embedding.word_embeddings.weight`` and sums their gradients)."""
    return name == "output_layer.weight" and getattr(param, "shared_embedding", False)


def _is_gated_fc1(name: str, config) -> bool:
    return config.gated_linear_unit and name.endswith("mlp.linear_fc1.weight")


def _join_tp(name: str, local: Tensor, param, config, group) -> Tensor:
    if not getattr(param, "tensor_model_parallel", False) or _size(group) == 1:
        return local
    dim = param.partition_dim
    parts = [torch.empty_like(local) for _ in range(_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    if _is_gated_fc1(name, config):  # each shard is [gate_i; up_i]
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def _split_tp(name: str, full: Tensor, param, config, group) -> Tensor:
    if not getattr(param, "tensor_model_parallel", False) or _size(group) == 1:
        return full
    dim, size, rank = param.partition_dim, _size(group), dist.get_rank(group)
    if _is_gated_fc1(name, config):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(size, dim=dim)[rank], up.chunk(size, dim=dim)[rank]], dim=dim)
    return full.chunk(size, dim=dim)[rank]


def full_state(model, which: str = "grad") -> Dict[str, Tensor]:
    """Every parameter (``which="param"``) or gradient (``"grad"``), unsharded, under
    stock Megatron names, on every rank (float32 CPU tensors).

    Collective over the tensor- and pipeline-parallel groups.
    """
    config = unwrap(model).config
    tp_group = parallel_state.get_tensor_model_parallel_group()

    def pick(p):
        if which == "param":
            return p.data
        grad = param_grad(p)
        return grad if grad is not None else torch.zeros_like(p)

    mine = {}
    for name, p in unwrap(model).named_parameters():
        if _tied_copy(name, p):
            continue
        local = _join_tp(name, pick(p).detach(), p, config, tp_group)
        mine[_global_name(model, name)] = local.to("cpu", torch.float32, copy=True)  # never a view of a live buffer
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if _size(pp_group) == 1:
        return mine
    stages = [None] * _size(pp_group)
    dist.all_gather_object(stages, mine, group=pp_group)
    out: Dict[str, Tensor] = {}
    for stage in stages:
        out.update(stage)
    return out


def load_full_state(model, state: Dict[str, Tensor]) -> None:
    """Load stock-named, unsharded weights into a (TP/PP-)sharded model.

    Raises:
        ValueError: a parameter is missing from ``state`` or has the wrong shape.
    """
    config = unwrap(model).config
    tp_group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        for name, p in unwrap(model).named_parameters():
            key = _EMBEDDING if _tied_copy(name, p) else _global_name(model, name)
            if key not in state:
                raise ValueError(f"state: missing parameter {key!r}")
            local = _split_tp(name, state[key], p, config, tp_group)
            if local.shape != p.shape:
                raise ValueError(f"state: {key!r} has shape {tuple(local.shape)} on this rank, "
                                 f"expected {tuple(p.shape)}")
            p.copy_(local)


def parallel_sizes() -> Optional[Dict[str, int]]:
    """The current TP/CP/PP/DP sizes (None before Megatron is initialised)."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "cp": parallel_state.get_context_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
    }
