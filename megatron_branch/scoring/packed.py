"""The packed-batch drop-in: log-probs of the batches RL stacks already build.

verl (jagged ids, then THD), slime (THD padded to a multiple), Megatron-RL (THD
``PackedSeqParams``) and NeMo-RL (padded ``[B, S]`` or THD) hand a model whole sequences
packed one after the other. :func:`packed_logprobs` takes such a batch as it is, finds the
shared prefixes itself (the sequences' prefix tree), computes every unique position once
(:func:`megatron_branch.rollout_logprobs`) and returns per-token log-probs in the batch's
own layout, differentiable: ``lp[i] = log p(tokens[i + 1] | the tokens <= i of its
sequence)``, 0 at each sequence's last token and at padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from megatron_branch.model import HOST
from megatron_branch.scoring.logprobs import rollout_logprobs
from megatron_branch.scoring.temperature import Temperature
from megatron_branch.tree import BranchTree


@dataclass(frozen=True)
class PackedLayout:
    """Where each sequence lives in the flat batch.

    Attributes:
        starts: ``[B]`` flat index of each sequence's first token.
        lengths: ``[B]`` real tokens of each sequence.
        total: entries of the flat batch (padding included).
    """

    starts: Tensor
    lengths: Tensor
    total: int

    def sequences(self, flat: Tensor) -> List[Tensor]:
        return [flat[int(s): int(s) + int(n)] for s, n in zip(self.starts, self.lengths)]


def _as_index(name: str, x, dim: int = 1) -> Tensor:
    t = torch.as_tensor(x, device=HOST)
    if t.dim() != dim or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"{name}: expected a {dim}-D integer tensor, got {tuple(t.shape)} {t.dtype}")
    return t.long()


def thd_layout(tokens: Tensor, cu_seqlens, cu_seqlens_padded=None, pad_multiple: Optional[int] = None) -> PackedLayout:
    """The layout of a THD batch: ``tokens [T]`` with sequence ``b`` at
    ``cu_seqlens[b]:cu_seqlens[b + 1]``, or, when each sequence is padded (verl, slime),
    its real ``cu_seqlens[b + 1] - cu_seqlens[b]`` tokens at the start of
    ``cu_seqlens_padded[b]:cu_seqlens_padded[b + 1]``.

    Raises:
        ValueError: ``cu_seqlens`` not starting at 0, not increasing, or not ending at the
            token count (a batch already split for context parallelism); padding shorter
            than its sequence or not a multiple of ``pad_multiple``; the sequence named.
    """
    if tokens.dim() != 1:
        raise ValueError(f"tokens: a THD batch is 1-D [T], got shape {tuple(tokens.shape)}")
    cu = _as_index("cu_seqlens", cu_seqlens)
    if cu.numel() < 2 or int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens: must start at 0 and hold at least one sequence, got {cu.tolist()[:8]}")
    lengths = cu[1:] - cu[:-1]
    bad = (lengths <= 0).nonzero()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"sequence {b}: cu_seqlens must increase, got {int(cu[b])} then {int(cu[b + 1])} "
                         "(an empty sequence)")
    if cu_seqlens_padded is None:
        starts, end = cu[:-1], int(cu[-1])
    else:
        cup = _as_index("cu_seqlens_padded", cu_seqlens_padded)
        if cup.shape != cu.shape or int(cup[0]) != 0:
            raise ValueError(f"cu_seqlens_padded: must start at 0 with one entry per cu_seqlens entry "
                             f"({cu.numel()}), got {cup.tolist()[:8]}")
        padded = cup[1:] - cup[:-1]
        short = (padded < lengths).nonzero()
        if short.numel():
            b = int(short[0])
            raise ValueError(f"sequence {b}: padded to {int(padded[b])} tokens, shorter than its {int(lengths[b])}")
        if pad_multiple is not None:
            off = (padded % pad_multiple != 0).nonzero()
            if off.numel():
                b = int(off[0])
                raise ValueError(f"sequence {b}: padded to {int(padded[b])} tokens, not a multiple of "
                                 f"pad_multiple={pad_multiple}")
        starts, end = cup[:-1], int(cup[-1])
    if end != tokens.numel():
        raise ValueError(f"cu_seqlens: ends at {end} but tokens holds {tokens.numel()} (a THD batch already split "
                         "for context parallelism? pass the whole batch: branch replay splits the tree itself)")
    return PackedLayout(starts, lengths, tokens.numel())


def padded_layout(tokens: Tensor, lengths) -> PackedLayout:
    """The layout of a right-padded ``[B, S]`` batch with real ``lengths [B]`` (row-major).

    Raises:
        ValueError: a length outside ``[1, S]`` (the sequence named) or of the wrong count.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens: a padded batch is 2-D [B, S], got shape {tuple(tokens.shape)}")
    b, s = tokens.shape
    n = _as_index("lengths", lengths)
    if n.numel() != b:
        raise ValueError(f"lengths: {n.numel()} entries for {b} sequences")
    bad = ((n < 1) | (n > s)).nonzero()
    if bad.numel():
        r = int(bad[0])
        raise ValueError(f"sequence {r}: lengths {int(n[r])} must be in [1, {s}]")
    return PackedLayout(torch.arange(b, device=HOST) * s, n, b * s)


def packed_logprobs(
    model,
    tokens: Tensor,
    cu_seqlens=None,
    *,
    lengths=None,
    cu_seqlens_padded=None,
    pad_multiple: Optional[int] = None,
    temperature: Optional[Temperature] = None,
    score_mask: Optional[Tensor] = None,
    entropy: bool = False,
    vocab_size: Optional[int] = None,
    routing: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Per-token log-probs of a packed batch of whole sequences, each unique position computed once.

    Args:
        model: a GPTModel built with the branch spec (as for :func:`megatron_branch.rollout_logprobs`).
        tokens: THD ``[T]`` token ids with ``cu_seqlens`` ``[B + 1]`` (``cu_seqlens_padded``
            when each sequence is padded, as verl and slime pad, to a multiple of
            ``pad_multiple``), or a right-padded ``[B, S]`` batch with ``lengths [B]``.
        temperature: the sampling temperature, one number or one per sequence.
        score_mask: like ``tokens``, nonzero where the loss reads ``lp`` (e.g. the response
            mask): the vocabulary projection runs only for those positions.
        entropy: also return per-token entropies in the same layout.
        vocab_size: check every token id against it.
        routing: rollout routing replay (MoE): the experts the engine chose for every
            token, laid out like ``tokens`` with two more dimensions: THD
            ``[T, moe_layers, topk]`` or padded ``[B, S, moe_layers, topk]`` (padding
            entries are ignored); see :func:`megatron_branch.rollout_logprobs`.

    Returns:
        ``lp`` shaped like ``tokens`` (float32), ``lp[i] = log p(tokens[i + 1] | <= i)``
        within its sequence, 0 at each sequence's last token and at padding; with
        ``entropy=True``, ``(lp, ent)``.

    Raises:
        ValueError: a malformed layout (see :func:`thd_layout`, :func:`padded_layout`), a
            ``score_mask`` or ``routing`` of another shape, a bad temperature or routing,
            or a token id outside the vocabulary; the sequence or field named.
    """
    if tokens.dim() == 2:
        if cu_seqlens is not None or lengths is None:
            raise ValueError("lengths: a padded [B, S] batch needs lengths (and no cu_seqlens)")
        layout = padded_layout(tokens, lengths)
    else:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens: a THD [T] batch needs cu_seqlens")
        layout = thd_layout(tokens, cu_seqlens, cu_seqlens_padded, pad_multiple)
    flat = tokens.reshape(-1)
    if score_mask is not None and tuple(score_mask.shape) != tuple(tokens.shape):
        raise ValueError(f"score_mask: shape {tuple(score_mask.shape)} does not match tokens {tuple(tokens.shape)}")
    tree = BranchTree.from_sequences([s.to(HOST) for s in layout.sequences(flat.detach())], vocab_size=vocab_size)
    width = max(tree.max_len - 1, 0)
    # flat index of each (sequence, position) of the per-rollout layout [R, max_len - 1]
    t = torch.arange(width, device=HOST)
    valid = t[None, :] < (layout.lengths - 1)[:, None]  # position t predicts token t + 1 of the sequence
    where = (layout.starts[:, None] + t[None, :])[valid]
    mask = None
    if score_mask is not None:
        flat_mask = score_mask.reshape(-1).to(HOST)
        mask = torch.zeros(tree.num_rollouts, width, dtype=torch.bool, device=HOST)
        mask[valid] = flat_mask[where] != 0
    per_sequence = None
    if routing is not None:
        if not isinstance(routing, Tensor) or routing.dim() != tokens.dim() + 2 or \
                tuple(routing.shape[: tokens.dim()]) != tuple(tokens.shape):
            got = tuple(routing.shape) if isinstance(routing, Tensor) else type(routing).__name__
            raise ValueError(f"routing: expected tokens' shape {tuple(tokens.shape)} + (moe_layers, topk), got {got}")
        per_sequence = layout.sequences(routing.reshape(-1, *routing.shape[tokens.dim():]))
    out = rollout_logprobs(model, tree, temperature=temperature, score_mask=mask, entropy=entropy,
                           routing=per_sequence)
    lp, ent = (out if entropy else (out, None))

    def scatter(values: Tensor) -> Tensor:
        full = values.new_zeros(layout.total)
        return full.index_put((where.to(values.device),), values[valid.to(values.device)]).reshape(tokens.shape)

    return (scatter(lp), scatter(ent)) if entropy else scatter(lp)
