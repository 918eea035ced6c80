"""Full (unsharded) weights and gradients across TP, PP and EP, under stock Megatron names.

:func:`full_state` / :func:`load_full_state` join tensor-parallel shards, renumber
pipeline stages' layers globally and number experts globally
(``local_experts.{ep_rank * local + i}``, joined over expert-TP), so the result is the
same whatever the layout; used by the HF conversion, the example's
``--dump-grads``/``--dump-params`` and to start parallel runs from one set of weights.
Gradients are read from Megatron DDP's ``main_grad`` when the model is wrapped (after
``finalize_model_grads`` every rank holds the reduced gradient of its shard).
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_branch.layout import ParallelLayout
from megatron_branch.model import param_grad, unwrap

_LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)(\..*)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT = re.compile(r"\.(weight|bias)\d+$")
EMBEDDING = "embedding.word_embeddings.weight"
# Persistent buffers that are weights of the model (replicated on every rank): the router's
# expert bias of aux-loss-free balancing (DeepSeek-V3's e_score_correction_bias)
WEIGHT_BUFFERS = (".router.expert_bias",)


def _weight_buffers(gpt):
    return [(n, b) for n, b in gpt.named_buffers() if b is not None and n.endswith(WEIGHT_BUFFERS)]


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def global_name(model, name: str) -> str:
    """``decoder.layers.{local}.`` -> ``decoder.layers.{global}.`` (pipeline stages)."""
    m = _LAYER.match(name)
    if not m:
        return name
    layer = unwrap(model).decoder.layers[int(m.group(2))]
    return f"{m.group(1)}{layer.layer_number - 1}{m.group(3)}"


def _global_expert_name(name: str, ep_rank: int, num_local: int) -> str:
    m = _LOCAL_EXPERT.match(name)
    return f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}{m.group(3)}"


def _tied_copy(name: str, param) -> bool:
    """The last pipeline stage's copy of tied word embeddings (Megatron keeps it equal to
    the first stage's ``embedding.word_embeddings.weight`` and sums their gradients)."""
    return name == "output_layer.weight" and getattr(param, "shared_embedding", False)


def _is_gated_fc1(name: str, config) -> bool:
    return config.gated_linear_unit and name.endswith("linear_fc1.weight")


def _sections(name: str, config, full: int) -> Optional[List[int]]:
    """Widths (unsharded) of the blocks a TP-sharded parameter concatenates, each split
    over the TP ranks on its own, or None for one contiguous block: ``[gate; up]`` of a
    gated ``linear_fc1``; Gated DeltaNet's ``in_proj`` ``[q; k; v; z; beta; alpha]`` and
    ``conv1d`` ``[q; k; v]`` (megatron-core 0.19's layout per rank)."""
    if _is_gated_fc1(name, config):
        return [full // 2, full // 2]
    if getattr(config, "experimental_attention_variant", None) == "gated_delta_net":
        qk = config.linear_key_head_dim * config.linear_num_key_heads
        v = config.linear_value_head_dim * config.linear_num_value_heads
        if name.endswith("self_attention.in_proj.weight"):
            return [qk, qk, v, v, config.linear_num_value_heads, config.linear_num_value_heads]
        if name.endswith(("self_attention.conv1d.weight", "self_attention.conv1d.bias")):
            return [qk, qk, v]
    return None


def _join_tp(name: str, local: Tensor, param, config, group) -> Tensor:
    if not getattr(param, "tensor_model_parallel", False) or _size(group) == 1:
        return local
    dim, size = param.partition_dim, _size(group)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    sections = _sections(name, config, local.shape[dim] * size)
    if sections:  # each shard is [block_0 / tp; block_1 / tp; ...]
        pieces = [p.split([w // size for w in sections], dim=dim) for p in parts]
        return torch.cat([pieces[r][i] for i in range(len(sections)) for r in range(size)], dim=dim)
    return torch.cat(parts, dim=dim)


def _split_tp(name: str, full: Tensor, param, config, group) -> Tensor:
    if not getattr(param, "tensor_model_parallel", False) or _size(group) == 1:
        return full
    dim, size, rank = param.partition_dim, _size(group), dist.get_rank(group)
    sections = _sections(name, config, full.shape[dim])
    if sections:
        return torch.cat([block.chunk(size, dim=dim)[rank] for block in full.split(sections, dim=dim)], dim=dim)
    return full.chunk(size, dim=dim)[rank]


def _num_local_experts(config, layout: ParallelLayout) -> int:
    return (getattr(config, "num_moe_experts", None) or 0) // layout.ep


def full_state(model, which: str = "grad") -> Dict[str, Tensor]:
    """Every parameter (``which="param"``, with the weight buffers :data:`WEIGHT_BUFFERS`) or
    gradient (``"grad"``), unsharded, under stock Megatron names, on every rank (float32 CPU tensors).

    Collective over the tensor-, pipeline-, expert- and expert-tensor-parallel groups.
    Sequential experts only (``moe_grouped_gemm=False``).

    Raises:
        ValueError: ``which`` is neither ``"grad"`` nor ``"param"``, or grouped expert weights.
    """
    if which not in ("grad", "param"):
        raise ValueError(f"which: {which!r} is not 'grad' or 'param'")
    gpt = unwrap(model)
    config = gpt.config
    layout = ParallelLayout.current()
    num_local = _num_local_experts(config, layout)
    mine: Dict[str, Tensor] = {}
    experts: Dict[str, Tensor] = {}
    for name, p in gpt.named_parameters():
        if _tied_copy(name, p):
            continue
        grad = param_grad(p)
        value = (p.data if which == "param" else grad if grad is not None else torch.zeros_like(p)).detach()
        if _LOCAL_EXPERT.match(name):
            if _GROUPED_EXPERT.search(name):
                raise ValueError(f"{name}: grouped expert weights are not supported (use moe_grouped_gemm=False)")
            value = _join_tp(name, value, p, config, layout.etp_group)
            key = _global_expert_name(global_name(model, name), layout.ep_rank, num_local)
            experts[key] = value.to("cpu", torch.float32, copy=True)
        else:
            value = _join_tp(name, value, p, config, layout.tp_group)
            mine[global_name(model, name)] = value.to("cpu", torch.float32, copy=True)  # never a view of a live buffer
    if which == "param":  # buffers have no gradient
        mine.update({global_name(model, n): b.detach().to("cpu", torch.float32, copy=True)
                     for n, b in _weight_buffers(gpt)})
    if layout.ep > 1 and experts:
        parts = [None] * layout.ep
        dist.all_gather_object(parts, experts, group=layout.ep_group)
        for part in parts:
            experts.update(part)
    mine.update(experts)
    if layout.pp == 1:
        return mine
    stages = [None] * layout.pp
    dist.all_gather_object(stages, mine, group=layout.pp_group)
    out: Dict[str, Tensor] = {}
    for stage in stages:
        out.update(stage)
    return out


def load_full_state(model, state: Dict[str, Tensor]) -> None:
    """Load stock-named, unsharded weights into a (TP/PP/EP-)sharded model: each rank
    takes its own slice, its own stage's layers and its own experts.

    Raises:
        ValueError: a parameter is missing from ``state`` or has the wrong shape.
    """
    gpt = unwrap(model)
    config = gpt.config
    layout = ParallelLayout.current()
    num_local = _num_local_experts(config, layout)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            key = EMBEDDING if _tied_copy(name, p) else global_name(model, name)
            expert = _LOCAL_EXPERT.match(name) is not None
            if expert:
                key = _global_expert_name(key, layout.ep_rank, num_local)
            if key not in state:
                raise ValueError(f"state: missing parameter {key!r}")
            local = _split_tp(name, state[key], p, config, layout.etp_group if expert else layout.tp_group)
            if local.shape != p.shape:
                raise ValueError(f"state: {key!r} has shape {tuple(local.shape)} on this rank, "
                                 f"expected {tuple(p.shape)}")
            p.copy_(local)
        for name, b in _weight_buffers(gpt):
            key = global_name(model, name)
            if key not in state:
                raise ValueError(f"state: missing buffer {key!r}")
            if state[key].shape != b.shape:
                raise ValueError(f"state: {key!r} has shape {tuple(state[key].shape)}, expected {tuple(b.shape)}")
            b.copy_(state[key])
