"""``replay_step``: a memory-bounded branch-replay forward/backward with a user's loss.

The tree is walked depth first (:mod:`megatron_branch.replay.plan`). A stem unit is
forwarded once and its per-layer K/V cached (:mod:`megatron_branch.attention.path_cache`); its
log-probs are handed to the loss as leaf tensors. Each chunk below it attends to the
cache, evaluates ``loss_fn`` on the rollouts that end in it, and runs its backward at
once, which accumulates parameter gradients, the stem's ``dK/dV`` and the gradients of
the stem's log-probs. When a stem's subtree is done, one backward of the stem feeds in
everything accumulated. The result equals ``loss.backward()`` over all rollouts.

Costs (U = unique positions, S = tokens in stem units):

* ``prefix_grad="exact"``, ``recompute_stem=False``: forward U, backward U; memory holds
  the activations of the stems on the current path plus one chunk.
* ``prefix_grad="exact"``, ``recompute_stem=True``: forward U + S, backward U; memory
  holds only the stems' K/V (2 x kv_heads x head_dim per token per layer) plus one chunk.
* ``prefix_grad="detached"`` (tail-only): forward U, backward U - S; the stem is a
  constant, so its parameters get no gradient through it — cheaper and biased
  (:func:`prefix_grad_bias` measures how much).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Literal, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from megatron_branch.scoring.output_rows import scored_tokens
from megatron_branch.peak_memory import PeakMemory
from megatron_branch.attention.path_cache import PathCache, StemRows
from megatron_branch.replay.plan import ReplayOp, path_capacity, plan_replay, unit_of_rollouts
from megatron_branch.scoring.vocab import check_model, model_device
from megatron_branch.training.ddp import GradSync, as_chunks, param_grad, single_chunk
from megatron_branch.tree import BranchTree
from megatron_branch.scoring.unit import ChildIndex, forward_unit, local_unit_rows

LossFn = Callable[[Tensor, Tensor], Union[Tensor, Tuple[Tensor, Tensor]]]
PrefixGrad = Literal["exact", "detached"]


@dataclass
class ReplayStats:
    """What a replay step did.

    Attributes:
        loss: the step's total loss (sum of ``loss_fn`` over chunks).
        num_chunks: chunk units (forward + loss + backward).
        num_stems: stem units (forwarded once, K/V cached).
        unique_positions: packed tree size ``U``.
        naive_positions: ``sum(len(rollout))``.
        positions_forwarded: token positions run through the model, recompute included.
        positions_recomputed: stem positions forwarded a second time.
        peak_cache_bytes: most K/V bytes held in the prefix cache at once.
        peak_memory_bytes: peak bytes allocated during the step (``measure_memory``).
        prefix_grad: ``"exact"`` or ``"detached"``.
        num_tokens: sum of the counts ``loss_fn`` returned with its losses (``None`` when
            it returned bare scalars): the normaliser of Megatron's per-token loss.
    """

    loss: float
    num_chunks: int
    num_stems: int
    unique_positions: int
    naive_positions: int
    positions_forwarded: int
    positions_recomputed: int
    peak_cache_bytes: int
    peak_memory_bytes: Optional[int]
    prefix_grad: str
    num_tokens: Optional[float] = None


@dataclass
class _Stem:
    rows: StemRows  # its rows in the path cache
    start: int
    end: int
    children: Tensor  # packed indices whose parent lies in the stem
    lp_graph: Optional[Tensor]  # their log-probs with the stem's graph (kept activations)


def split_loss(out) -> Tuple[Tensor, Optional[Tensor]]:
    """``loss_fn``'s result as ``(loss, count or None)``."""
    loss, count = (out[0], out[1]) if isinstance(out, (tuple, list)) and len(out) == 2 else (out, None)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn: must return a scalar tensor (or a (loss, num_tokens) pair), got {shape}")
    return loss.reshape(()), count


class _Replayer:
    def __init__(self, model, tree: BranchTree, loss_fn: LossFn, exact: bool, recompute_stem: bool,
                 cp_comm_type: str, capacity: int, scored: Optional[Tensor] = None):
        self.model, self.tree, self.loss_fn = model, tree, loss_fn
        self.exact, self.recompute_stem = exact, recompute_stem
        self.cp_comm_type = cp_comm_type
        self.scored = scored
        self.grad_on = torch.is_grad_enabled()
        self.device = model_device(model)
        self.stack: List[_Stem] = []
        self.cache = PathCache(capacity, requires_grad=exact)
        # log-probs of the stems' children, a leaf: chunk losses accumulate their gradients
        self.lp_known = torch.zeros(tree.unique_positions, dtype=torch.float32, device=self.device,
                                    requires_grad=exact)
        self.total = 0.0
        self.count: Optional[float] = None
        self.forwarded = self.recomputed = 0
        self.children = ChildIndex(tree)
        self.sync = GradSync(model)
        self.final = False  # the step's last backward: Megatron DDP may reduce in it

    def backward(self, tensors, grads=None) -> None:
        ctx = contextlib.nullcontext() if self.final else self.sync.hold()
        with ctx:
            torch.autograd.backward(tensors, grads)

    def forward_unit(self, start: int, end: int, **stem):
        self.forwarded += end - start
        idx, lp, _ = forward_unit(
            self.model, self.tree, start, end, self.children, cp_comm_type=self.cp_comm_type,
            scored=self.scored, cache=self.cache, **stem,
        )
        return idx, lp

    def evaluate(self, rollouts: Sequence[int], own: Optional[tuple] = None) -> None:
        """loss_fn on ``rollouts`` from the stems' leaf log-probs (and this unit's graph)."""
        lp_vec = self.lp_known
        if own is not None:
            lp_vec = lp_vec.index_put((own[0].to(self.device),), own[1])
        ids = torch.tensor(rollouts, dtype=torch.long)
        rows = self.tree.rows[ids, 1:].to(self.device)
        lp = torch.where(rows >= 0, lp_vec[rows.clamp(min=0)], torch.zeros((), device=self.device))
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
        keep = self.exact and not self.recompute_stem
        stem_id = self.cache.begin_stem()
        ctx = contextlib.nullcontext() if keep else torch.no_grad()
        with ctx:
            children, lp = self.forward_unit(op.start, op.end, stem_id=stem_id, inject=keep)
        rows = self.cache.push()
        with torch.no_grad():
            self.lp_known[children.to(self.device)] = lp.detach().float()
        self.stack.append(_Stem(rows, op.start, op.end, children, lp if keep else None))
        if rollouts:
            self.evaluate(rollouts)

    def pop(self) -> None:
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
        own = self.forward_unit(op.start, op.end)
        self.evaluate(rollouts, own)


def replay_step(
    model,
    tree: BranchTree,
    loss_fn: LossFn,
    *,
    max_chunk_tokens: Optional[int] = None,
    prefix_grad: PrefixGrad = "exact",
    recompute_stem: bool = False,
    group_ids: Optional[Sequence[int]] = None,
    measure_memory: bool = False,
    cp_comm_type: str = "allgather",
    score_mask: Optional[Tensor] = None,
) -> ReplayStats:
    """One branch-replay forward/backward of ``loss_fn`` over the rollouts of ``tree``.

    Args:
        model: a GPTModel built with :func:`get_branch_layer_spec`, possibly wrapped
            (``Float16Module``, Megatron's ``DistributedDataParallel``), or a one-element
            list of such chunks. Under Megatron DDP the gradients accumulate in
            ``main_grad`` and every backward but the last is run under ``no_sync()``, so
            with ``overlap_grad_reduce`` each bucket is reduced once, after its last
            contribution (held entirely when called inside the caller's ``no_sync()``).
        tree: the packed rollouts.
        loss_fn: ``(lp [r, max_len - 1], rollout_ids [r]) -> scalar`` or
            ``-> (loss_sum, num_tokens)``, called once per chunk with the rollouts that end
            in it (``lp`` as from ``rollout_logprobs``). The step's loss is the sum over
            calls, so the loss must be additive over rollouts: normalise by global counts
            (``mb.losses`` ``global_tokens`` / ``global_seqs``), or return sums and counts
            and let Megatron normalise (``calculate_per_token_loss``; see
            :mod:`megatron_branch.training`).
        max_chunk_tokens: most tokens per forward; ``None`` runs one packed pass.
        prefix_grad: ``"exact"`` (gradients equal per-rollout training) or
            ``"detached"`` (tail-only: stems are constants).
        recompute_stem: recompute each stem's forward for its backward instead of
            keeping its activations (exact mode only; trades compute for memory).
        group_ids: ``[R]``; rollouts with equal ids reach ``loss_fn`` together (DPO pairs).
        measure_memory: record ``peak_memory_bytes`` (slower on CPU).
        cp_comm_type: context-parallel K/V exchange (``"allgather"`` or ``"p2p"``); the
            stems' cached K/V stay sharded over the CP ranks.
        score_mask: ``[R, max_len - 1]``, nonzero where ``loss_fn`` reads ``lp`` (e.g. the
            response mask): logits are computed only for those tokens' parents, and the
            other entries of ``lp`` are 0. ``None`` scores every token.

    Returns:
        :class:`ReplayStats`. Parameter ``.grad`` (``main_grad`` under Megatron DDP) hold
        the accumulated gradient, as after ``loss.backward()``. Under ``torch.no_grad()``
        nothing is backpropagated.

    Raises:
        ValueError: the model lacks tree attention, a bad ``prefix_grad`` or budget, a
            ``loss_fn`` that does not return a scalar, or groups that cannot fit.
    """
    if prefix_grad not in ("exact", "detached"):
        raise ValueError(f"prefix_grad: {prefix_grad!r} is not one of ('exact', 'detached')")
    model = single_chunk(model, "replay_step")
    check_model(model, tree)
    ops = plan_replay(tree, max_chunk_tokens, group_ids)
    owners: Dict[int, List[int]] = unit_of_rollouts(tree, ops)
    exact = prefix_grad == "exact" and torch.is_grad_enabled()
    scored = None if score_mask is None else scored_tokens(tree, score_mask)
    # each CP rank caches only its share of every stem
    capacity = path_capacity(ops, lambda op: local_unit_rows(model, tree, op.start, op.end))
    run = _Replayer(model, tree, loss_fn, exact, recompute_stem, cp_comm_type, capacity, scored)
    last_backward = max((i for i, op in enumerate(ops) if op.kind == "chunk" or (op.kind == "pop" and exact)),
                        default=-1)
    meter = PeakMemory(run.device) if measure_memory else contextlib.nullcontext()
    with meter:
        for i, op in enumerate(ops):
            run.final = i == last_backward
            if op.kind == "stem":
                run.stem(op, owners.get(i, []))
            elif op.kind == "chunk":
                run.chunk(op, owners.get(i, []))
            else:
                run.pop()
    return ReplayStats(
        loss=run.total,
        num_chunks=sum(op.kind == "chunk" for op in ops),
        num_stems=sum(op.kind == "stem" for op in ops),
        unique_positions=tree.unique_positions,
        naive_positions=tree.naive_positions,
        positions_forwarded=run.forwarded,
        positions_recomputed=run.recomputed,
        peak_cache_bytes=run.cache.peak_bytes,
        peak_memory_bytes=meter.peak_bytes if measure_memory else None,
        prefix_grad=prefix_grad,
        num_tokens=run.count,
    )


def replay_logprobs(
    model, tree: BranchTree, *, max_chunk_tokens: Optional[int] = None, score_mask: Optional[Tensor] = None,
    cp_comm_type: str = "allgather", group_ids: Optional[Sequence[int]] = None,
) -> Tensor:
    """Forward-only ``[R, max_len - 1]`` log-probs with the same chunking (old/ref policy).

    Runs under ``torch.no_grad()``; memory is bounded like :func:`replay_step`'s.
    ``score_mask`` and ``group_ids`` as for :func:`replay_step` (the same plan as a step
    with those ``group_ids``; the log-probs do not depend on it).
    """
    model = single_chunk(model, "replay_logprobs")
    out = torch.zeros(tree.num_rollouts, max(tree.max_len - 1, 0), dtype=torch.float32)

    def collect(lp: Tensor, ids: Tensor) -> Tensor:
        out[ids] = lp.detach().float().cpu()
        return lp.new_zeros(())

    with torch.no_grad():
        replay_step(model, tree, collect, max_chunk_tokens=max_chunk_tokens, score_mask=score_mask,
                    cp_comm_type=cp_comm_type, group_ids=group_ids)
    return out.to(model_device(model))


def _grads(model) -> List[Optional[Tensor]]:
    return [None if param_grad(p) is None else param_grad(p).detach().clone() for p in model.parameters()]


def _set_grads(model, grads: Sequence[Optional[Tensor]]) -> None:
    for p, g in zip(model.parameters(), grads):
        main = getattr(p, "main_grad", None)
        if main is not None:
            main.copy_(g if g is not None else torch.zeros_like(main))
        else:
            p.grad = g


def _flat(grads: Sequence[Optional[Tensor]], model) -> Tensor:
    return torch.cat([
        (g if g is not None else torch.zeros_like(p)).float().reshape(-1) for g, p in zip(grads, model.parameters())
    ])


def prefix_grad_bias(model, tree: BranchTree, loss_fn: LossFn, **kwargs) -> Dict[str, float]:
    """How far the tail-only gradient is from the exact one, for the same step.

    Runs the step in both modes (gradients, ``main_grad`` under Megatron DDP, are
    restored afterwards; DDP's reduction is held) and returns ``cosine`` (cosine
    similarity), ``rel_norm`` (``|g_detached| / |g_exact|``) and ``rel_error``
    (``|g_detached - g_exact| / |g_exact|``) of this rank's local gradients.
    """
    model = single_chunk(model, "prefix_grad_bias")
    saved = _grads(model)
    zeros = [None] * len(saved)
    grads = {}
    with GradSync(as_chunks(model)).hold():
        for mode in ("exact", "detached"):
            _set_grads(model, zeros)
            replay_step(model, tree, loss_fn, prefix_grad=mode, **kwargs)
            grads[mode] = _flat(_grads(model), model)
    _set_grads(model, saved)
    exact, detached = grads["exact"], grads["detached"]
    norm = exact.norm().clamp(min=1e-30)
    return {
        "cosine": float(torch.nn.functional.cosine_similarity(exact, detached, dim=0)),
        "rel_norm": float(detached.norm() / norm),
        "rel_error": float((detached - exact).norm() / norm),
    }
