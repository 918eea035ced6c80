"""Rollout routing replay (R3) under branch replay: the engine's experts, once per unique token.

The rollout engine records, per rollout, the experts its MoE routers chose at each position
(``[len_r, moe_layers, topk]``); training forces the same experts so that the trainer's
MoE computes what the engine sampled from. Under branch replay a shared token is computed
once, so it needs one routing: :func:`tree_routing` checks the rollouts' routing and maps
it onto the tree's unique tokens (:class:`TreeRouting`, ``[U, moe_layers, topk]``). It
travels with each forward in ``BranchPackedSeqParams.routing``; every MoE layer's router
(:class:`~megatron_branch.spec.moe.router.BranchTopKRouter`) hands its column to
Megatron-Core's ``RouterReplay`` (``REPLAY_FORWARD``) for that forward. Because the
routing is bound to the forward's tree data, Megatron's activation recompute (and a
recomputed stem) replays the same experts in the backward.

Conditions:

* a megatron-core with ``RouterReplay`` (0.16.1 and 0.19.2 have it),
  ``TransformerConfig(moe_enable_routing_replay=True)`` (its routers then hold one) and
  ``moe_router_fusion=False`` (the fused top-k bypasses the replay);
* the experts of a token are a set: their order within a top-k row does not matter
  (Megatron scatters the probabilities into ``[tokens, experts]``), a repeated expert is
  refused;
* **disagreement**: rollouts that share a token (the same prefix, hence the same packed
  position) must give it the same experts in every MoE layer, as a prefix-cached engine
  does; otherwise ``ValueError`` names the two rollouts, the position and the layer.
  Split such rollouts into separate trees (``BranchTree.from_sequences(..., share_limit=)``
  stops sharing at a depth) if the engine really routed them differently.

Every position of a rollout needs a row, the last token's included (an engine that records
nothing for it, since it is sampled and never forwarded, leaves it to the caller: repeat
the previous row; a leaf's last token feeds no log-prob).

Router statistics (aux losses, z-loss) do not change: Megatron computes them from the
router's own scores, not from the replayed experts; the expert-bias counts count the
replayed experts, as Megatron does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_branch._megatron import RouterReplay, router_replay_unavailable_reason
from megatron_branch.layout import ParallelLayout
from megatron_branch.model import HOST
from megatron_branch.tree import BranchTree

Routing = Union[Sequence[Tensor], Tensor]


@dataclass
class TreeRouting:
    """The replayed experts of every unique token of a tree.

    Attributes:
        experts: ``[U, moe_layers, topk]`` (host; int16, or int32 beyond 32767 experts)
            expert ids of each packed token, sorted within each top-k row.
        columns: decoder layer number (``TopKRouter.layer_number``, 1-based, global over
            pipeline stages) of each MoE layer -> its column in ``experts``.
    """

    experts: Tensor
    columns: Dict[int, int]

    @property
    def topk(self) -> int:
        return self.experts.shape[2]

    def rows(self, index: Tensor, device=None) -> Tensor:
        """``[n, moe_layers, topk]`` experts of the packed tokens ``index [n]`` (``-1`` =
        padding, routed to experts ``0..topk-1``: it has multiplicity 0 and no real token
        sees it)."""
        index = index.to(HOST)
        pad = index < 0
        out = self.experts[index.clamp(min=0)].long()  # [n, L, k]
        if bool(pad.any()):
            out[pad] = torch.arange(self.topk, dtype=out.dtype)
        return out.to(device) if device is not None else out

    def column(self, layer_number: int) -> int:
        """The column of the MoE layer with decoder layer number ``layer_number``."""
        if layer_number not in self.columns:
            raise ValueError(f"routing: decoder layer {layer_number} is not one of the MoE layers the routing was "
                             f"prepared for ({sorted(self.columns)})")
        return self.columns[layer_number]


def moe_layer_columns(found: List) -> Dict[int, int]:
    """Decoder layer number -> MoE layer index (0-based, in layer order over the whole
    model) of the routers ``found`` (a model's ``BranchTopKRouter`` modules). Under
    pipeline parallelism the stages' layer numbers are gathered: a collective over the
    pipeline group, so every stage calls it (once per step, outside the schedule)."""
    numbers = sorted(int(r.layer_number) for r in found)
    layout = ParallelLayout.current()
    if layout.pp > 1 and layout.pp_group is not None:
        gathered: List[Optional[List[int]]] = [None] * layout.pp
        dist.all_gather_object(gathered, numbers, group=layout.pp_group)
        numbers = sorted({n for stage in gathered for n in stage})
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"routing: MoE routers with repeated layer numbers {numbers} (multi-token prediction "
                         "layers?) cannot be told apart")
    return {n: i for i, n in enumerate(numbers)}


def check_routing_model(found: List, columns: Optional[Dict[int, int]] = None, config=None) -> None:
    """Raise unless the routers ``found`` (this pipeline stage's; ``columns``: the whole
    model's MoE layers, :func:`moe_layer_columns`) can replay given experts (see the
    module docstring). ``config``: the model's, when this stage has no router.

    Raises:
        ValueError: no MoE layers, a megatron-core without RouterReplay, ``moe_enable_routing_replay``
            off, ``moe_router_fusion`` on, or routers holding another RouterReplay class; the field named.
    """
    if not found and not columns:
        raise ValueError("routing: the model has no MoE layers (routing replays the experts of MoE routers); "
                         "pass routing=None")
    reason = router_replay_unavailable_reason(found[0].config if found else config)
    if reason is None and any(getattr(r, "router_replay", None) is None for r in found):
        reason = "a router of the model has no RouterReplay (moe_enable_routing_replay was off when it was built)"
    # another RouterReplay class (e.g. one a trainer patched in process-wide) compares its own
    # action enum: Megatron's REPLAY_FORWARD would then route natively, silently
    foreign = sorted({type(r.router_replay).__module__ + "." + type(r.router_replay).__qualname__ for r in found
                      if getattr(r, "router_replay", None) is not None
                      and not isinstance(r.router_replay, RouterReplay)})
    if reason is None and foreign:
        reason = (f"the model's routers hold {', '.join(foreign)}, not Megatron-Core's RouterReplay (a process-wide "
                  "patch applied before the model was built); build the model without it")
    if reason:
        raise ValueError(f"routing: {reason}")


def _locate(offsets: Tensor, j: int) -> tuple:
    """``(i, t)``: the rollout and position of entry ``j`` of the rollouts' joined positions."""
    i = int(torch.searchsorted(offsets, torch.tensor(j), right=True)) - 1
    return i, j - int(offsets[i])


def tree_routing(tree: BranchTree, routing: Optional[Routing], found: List, *,
                 rollout_ids: Optional[Sequence[int]] = None,
                 columns: Optional[Dict[int, int]] = None, config=None) -> Optional[TreeRouting]:
    """Check the rollouts' replayed experts and map them onto the tree's unique tokens.

    Args:
        tree: the packed rollouts.
        routing: per rollout ``r`` of ``tree``, an integer tensor ``[len_r, moe_layers,
            topk]``: the experts the engine chose at each position in each MoE layer (in
            layer order); or one ``[R, >= max_len, moe_layers, topk]`` tensor, right-padded,
            read up to each rollout's length. ``None``: no replay (returns ``None``); a
            :class:`TreeRouting` of this tree is returned as it is.
        found: the model's ``BranchTopKRouter`` modules (``scoring.checks.check_model``).
        rollout_ids: the names of the tree's rollouts in errors (a micro-batch's rollouts
            in the global batch); default ``0..R-1``.
        columns: :func:`moe_layer_columns` of the model, when the caller has them
            (computing them is a collective under pipeline parallelism).
        config: the model's ``TransformerConfig`` (default: the first router's; needed
            on a pipeline stage without MoE layers).

    Returns:
        the :class:`TreeRouting`, or ``None`` without ``routing``.

    Raises:
        ValueError: the model cannot replay routing (:func:`check_routing_model`); a
            count of tensors other than the rollouts'; a rollout's routing that is not an
            integer tensor, has a shape other than ``[len_r, moe_layers, topk]`` (``topk``
            the model's ``moe_router_topk``), holds an expert id outside
            ``[0, num_moe_experts)`` or one expert twice in a row (the rollout, position and
            layer named); rollouts sharing a token with different experts for it (both
            rollouts, the position and the layer named).
    """
    if routing is None or isinstance(routing, TreeRouting):
        return routing
    columns = columns if columns is not None else moe_layer_columns(found)
    check_routing_model(found, columns, config)
    config = found[0].config if found else config
    layers, topk, num_experts = len(columns), int(config.moe_router_topk), int(config.num_moe_experts)
    num = tree.num_rollouts
    names = [int(r) for r in rollout_ids] if rollout_ids is not None else list(range(num))
    lengths = tree.lengths.tolist()
    if isinstance(routing, Tensor) and routing.dim() == 4:
        if routing.shape[0] != num or routing.shape[1] < max(lengths):
            raise ValueError(f"routing: a padded tensor must be [R, >= max_len, moe_layers, topk] = "
                             f"[{num}, >= {max(lengths)}, {layers}, {topk}], got {tuple(routing.shape)}")
        routing = [routing[i, :n] for i, n in enumerate(lengths)]
    if isinstance(routing, Tensor) or not isinstance(routing, Sequence) or len(routing) != num:
        got = f"a tensor of shape {tuple(routing.shape)}" if isinstance(routing, Tensor) else (
            f"{len(routing)} entries" if isinstance(routing, Sequence) else type(routing).__name__)
        raise ValueError(f"routing: expected one [len_r, moe_layers, topk] tensor per rollout ({num}), got {got}")
    # expert ids kept in 16 bits where they fit: the naive positions x layers x top-k can be large
    narrow = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
    number = {c: n for n, c in columns.items()}
    checked = []
    for i, x in enumerate(routing):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"rollout {names[i]}: routing must be an integer tensor ({exc})") from None
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"rollout {names[i]}: routing must be an integer tensor of expert ids, "
                             f"got dtype {x.dtype}")
        if x.dim() == 3 and x.shape[:2] == (lengths[i], layers) and x.shape[2] != topk:
            raise ValueError(f"rollout {names[i]}: routing has {x.shape[2]} experts per token, the model routes "
                             f"each token to moe_router_topk={topk}")
        if x.dim() != 3 or tuple(x.shape) != (lengths[i], layers, topk):
            raise ValueError(f"rollout {names[i]}: routing has shape {tuple(x.shape)}, expected [len_r, moe_layers, "
                             f"topk] = [{lengths[i]}, {layers}, {topk}]")
        x = x.detach().to(HOST)
        bad = ((x < 0) | (x >= num_experts)).nonzero()  # in the given dtype, before narrowing
        if bad.numel():
            t, layer, slot = (int(v) for v in bad[0])
            raise ValueError(f"rollout {names[i]}: routing position {t}, MoE layer {layer} (decoder layer "
                             f"{number[layer]}) names expert {int(x[t, layer, slot])}, outside "
                             f"[0, num_moe_experts={num_experts})")
        checked.append(x.to(narrow))
    flat = torch.cat(checked)  # [N, L, k], the rollouts' positions joined
    offsets = torch.tensor([0] + lengths, device=HOST).cumsum(0)

    def where(j: int, layer: int) -> str:
        i, t = _locate(offsets, j)
        return f"rollout {names[i]}: routing position {t}, MoE layer {layer} (decoder layer {number[layer]})"

    ordered = flat.sort(dim=-1).values  # the experts of a token are a set
    twice = (ordered[..., 1:] == ordered[..., :-1]).nonzero()
    if twice.numel():
        j, layer, slot = (int(v) for v in twice[0])
        raise ValueError(f"{where(j, layer)} names expert {int(ordered[j, layer, slot])} twice (the top-k experts "
                         "of a token are distinct)")
    rows = torch.cat([tree.rows[i, :n] for i, n in enumerate(lengths)]).to(HOST)  # [N] packed index
    experts = torch.empty(tree.unique_positions, layers, topk, dtype=narrow, device=HOST)
    experts[rows] = ordered  # a shared token: any of its rollouts' rows, checked next
    differs = (experts[rows] != ordered).any(-1).nonzero()  # [*, 2] (entry, layer)
    if differs.numel():
        j, layer = (int(v) for v in differs[0])
        i, t = _locate(offsets, j)
        token = int(rows[j])
        same = (rows == token).nonzero()[:, 0]
        other = next(int(o) for o in same if not torch.equal(ordered[o, layer], ordered[j, layer]))
        k, _ = _locate(offsets, other)
        a, b = sorted((i, k))
        ea = ordered[j if a == i else other, layer].tolist()
        eb = ordered[other if a == i else j, layer].tolist()
        raise ValueError(
            f"routing: rollouts {names[a]} and {names[b]} share the token at position {t} (packed index {token}) "
            f"but route it differently at MoE layer {layer} (decoder layer {number[layer]}): experts {ea} vs {eb}. "
            "Branch replay computes a shared token once, so it needs one routing (a prefix-cached engine records "
            "one); build separate trees for rollouts the engine routed differently")
    return TreeRouting(experts, dict(columns))
