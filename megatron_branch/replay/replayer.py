"""The replayer: runs a replay plan's stem, chunk and pop steps on one model.

Our own code. State of one step, walked depth first (:mod:`megatron_branch.replay.plan`):

* the **stack** of stems on the current path (root first) and their rows in the
  :class:`~megatron_branch.attention.path_cache.PathCache`, which holds every stem's
  per-layer K/V so that each unit below attends to its whole path in one piece;
* ``lp_known``, a ``[U]`` leaf holding the log-probs of the stems' children: a chunk's
  loss reads them as constants and their ``.grad`` collects what the stem's backward
  must feed in (the stems' own tokens' share of the loss gradient);
* the step's totals (loss, token count, positions forwarded and recomputed).

``stem`` forwards a stem once and pushes it; ``chunk`` forwards a chunk, evaluates the
loss of the rollouts that end in it and backpropagates at once (into parameters, the
path cache's ``dK``/``dV`` accumulators and ``lp_known.grad``); ``pop`` runs the stem's
own backward with everything accumulated for it. Under Megatron DDP every backward but
the step's last is held (:class:`~megatron_branch.model.GradSync`), so each gradient
bucket is reduced once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from megatron_branch.attention.path_cache import PathCache, StemRows
from megatron_branch.losses import batch_part
from megatron_branch.model import HOST, GradSync, model_device
from megatron_branch.replay.plan import ReplayOp
from megatron_branch.scoring.logprobs import per_rollout
from megatron_branch.scoring.temperature import Temperatures
from megatron_branch.scoring.unit import ChildIndex, forward_unit
from megatron_branch.spec.moe.routing_replay import TreeRouting
from megatron_branch.tree import BranchTree

LossFn = Callable[[Tensor, Tensor], Union[Tensor, Tuple[Tensor, Tensor]]]


def split_loss(out) -> Tuple[Tensor, Optional[Tensor]]:
    """``loss_fn``'s result as ``(loss, count or None)``.

    Raises:
        ValueError: not a scalar tensor or a ``(loss, num_tokens)`` pair.
    """
    loss, count = (out[0], out[1]) if isinstance(out, (tuple, list)) and len(out) == 2 else (out, None)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn: must return a scalar tensor (or a (loss, num_tokens) pair), got {shape}")
    return loss.reshape(()), count


@dataclass
class StemState:
    """A stem on the replayer's stack.

    Attributes:
        rows: its rows in the path cache (this rank's share).
        start, end: its packed range.
        children: ``[m]`` packed indices of the tokens whose parent lies in the stem.
        lp_graph: their log-probs with the stem's graph (activations kept), or ``None``
            when the graph is rebuilt at the pop (``recompute_stem``, tail-only).
    """

    rows: StemRows
    start: int
    end: int
    children: Tensor
    lp_graph: Optional[Tensor]


class Replayer:
    """Runs the steps of one replay plan (see the module docstring).

    Args:
        model: one model chunk with the branch spec.
        tree: the packed tree.
        loss_fn: ``(lp [r, max_len - 1], rollout_ids [r]) -> loss`` or ``(loss_sum, num_tokens)``.
        exact: backpropagate into the stems (``prefix_grad="exact"``, gradients enabled).
        recompute_stem: drop a stem's activations after its forward and recompute them at its pop.
        cp_comm_type: context-parallel K/V exchange.
        capacity: rows of the path cache (this rank's share of the deepest stem path).
        scored: ``[U]`` bool, the tokens whose log-probs the loss reads (``None``: all).
        temperatures: the rollouts' sampling temperatures (``None``: 1.0).
        routing: the experts every MoE router replays (rollout routing replay), or None;
            bound to each unit's forward, so a recomputed stem replays them too.
    """

    def __init__(self, model, tree: BranchTree, loss_fn: LossFn, exact: bool, recompute_stem: bool,
                 cp_comm_type: str, capacity: int, scored: Optional[Tensor] = None,
                 temperatures: Optional[Temperatures] = None, routing: Optional[TreeRouting] = None):
        self.model, self.tree, self.loss_fn = model, tree, loss_fn
        self.exact, self.recompute_stem = exact, recompute_stem
        self.cp_comm_type = cp_comm_type
        self.scored = scored
        self.routing = routing
        self.temps = temperatures or Temperatures.of(1.0, tree.num_rollouts)
        self.grad_on = torch.is_grad_enabled()
        self.device = model_device(model)
        self.stack: List[StemState] = []
        self.cache = PathCache(capacity, requires_grad=exact)
        # log-probs of the stems' children (a column per temperature), a leaf: chunk losses
        # accumulate their gradients
        self.lp_known = torch.zeros(tree.unique_positions, self.temps.count, dtype=torch.float32, device=self.device,
                                    requires_grad=exact)
        self.total = 0.0
        self.count: Optional[float] = None
        self.forwarded = self.recomputed = 0
        self.children = ChildIndex(tree)
        self.sync = GradSync(model)
        self.final = False  # the step's last backward: Megatron DDP may reduce in it
        # called once, right after the plan's last unit forward (before its backward)
        self.after_last_forward: Optional[Callable[[], None]] = None
        self._forwards_left = 0

    def run(self, ops: Sequence[ReplayOp], owners: Dict[int, List[int]]) -> None:
        """Run the plan ``ops``; ``owners[i]`` lists the rollouts whose loss op ``i`` evaluates."""
        last_backward = max((i for i, op in enumerate(ops) if op.kind == "chunk" or (op.kind == "pop" and self.exact)),
                            default=-1)
        self._forwards_left = sum(op.kind in ("stem", "chunk") for op in ops)
        for i, op in enumerate(ops):
            self.final = i == last_backward
            if op.kind == "stem":
                self.stem(op, owners.get(i, []))
            elif op.kind == "chunk":
                self.chunk(op, owners.get(i, []))
            else:
                self.pop()

    def backward(self, tensors, grads=None) -> None:
        """``torch.autograd.backward``, with Megatron DDP's reduction held unless it is the step's last."""
        ctx = contextlib.nullcontext() if self.final else self.sync.hold()
        with ctx:
            torch.autograd.backward(tensors, grads)

    def unit_done(self) -> None:
        """A planned unit's forward is done (a stem's recompute at its pop is not one)."""
        self._forwards_left -= 1
        if self._forwards_left == 0 and self.after_last_forward is not None:
            hook, self.after_last_forward = self.after_last_forward, None
            hook()

    def forward_unit(self, start: int, end: int, **stem) -> Tuple[Tensor, Tensor]:
        """Forward the unit ``[start, end)`` below the current path: ``(children [m], lp [m, k])``."""
        self.forwarded += end - start
        idx, lp, _ = forward_unit(
            self.model, self.tree, start, end, self.children, cp_comm_type=self.cp_comm_type,
            scored=self.scored, temperatures=None if self.temps.is_one else self.temps.values,
            cache=self.cache, routing=self.routing, **stem,
        )
        return idx, lp

    def evaluate(self, rollouts: Sequence[int], own: Optional[tuple] = None) -> None:
        """``loss_fn`` on ``rollouts``, reading the stems' log-probs from ``lp_known`` and
        this unit's (``own = (children, lp)``, with its graph); backward at once."""
        lp_vec = self.lp_known
        if own is not None:
            lp_vec = lp_vec.index_put((own[0].to(self.device),), own[1])
        ids = torch.tensor(rollouts, dtype=torch.long, device=HOST)  # indexes the host tree rows
        lp = per_rollout(lp_vec, self.tree, ids, column=self.temps.column)
        with batch_part(len(rollouts), self.tree.num_rollouts):  # mb.losses refuse per-call normalisers
            loss, count = split_loss(self.loss_fn(lp, ids))
        self.total += float(loss.detach())
        if count is not None:
            self.count = (self.count or 0.0) + float(count)
        if not self.grad_on:
            return
        if loss.requires_grad:
            self.backward([loss])
        elif self.final and own is not None and own[1].requires_grad:
            # Nothing to learn from these rollouts, but the step's final backward must still
            # reach every parameter so that Megatron DDP's overlapped buckets are reduced.
            self.backward([own[1].sum() * 0.0])

    def stem(self, op: ReplayOp, rollouts: Sequence[int]) -> None:
        """Forward the stem ``op`` once (its K/V into the cache), push it, and evaluate the
        rollouts that end inside it."""
        keep = self.exact and not self.recompute_stem
        stem_id = self.cache.begin_stem()
        ctx = contextlib.nullcontext() if keep else torch.no_grad()
        with ctx:
            children, lp = self.forward_unit(op.start, op.end, stem_id=stem_id, inject=keep,
                                             stem_rows=op.cached_end - op.start)
        self.unit_done()
        rows = self.cache.push()
        with torch.no_grad():
            self.lp_known[children.to(self.device)] = lp.detach().float()
        self.stack.append(StemState(rows, op.start, op.end, children, lp if keep else None))
        if rollouts:
            self.evaluate(rollouts)

    def pop(self) -> None:
        """The stem on top of the stack is done: run its backward with the gradients
        accumulated for its K/V (every layer, through the cache's inject nodes) and for
        its children's log-probs, then release its rows."""
        stem = self.stack.pop()
        rows = self.cache.pop()
        if not self.exact:
            self.cache.release(rows)
            return
        lp = stem.lp_graph
        if lp is None:  # recompute the stem's forward, now with its graph
            self.cache.begin_stem(rows.stem_id)
            _, lp = self.forward_unit(stem.start, stem.end, stem_id=rows.stem_id, inject=True)
            self.cache.open = None
            self.recomputed += stem.end - stem.start
        known = self.lp_known.grad
        grad = known[stem.children.to(self.device)] if known is not None else torch.zeros_like(lp)
        # Also adds every layer's accumulated dK/dV through the InjectGrad nodes.
        self.backward([lp], [grad.to(lp.dtype)])
        self.cache.release(rows)

    def chunk(self, op: ReplayOp, rollouts: Sequence[int]) -> None:
        """Forward the chunk ``op`` below the path, evaluate its rollouts, backward at once."""
        own = self.forward_unit(op.start, op.end)
        self.unit_done()
        self.evaluate(rollouts, own)
