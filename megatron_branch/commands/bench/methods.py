"""The methods the benchmark compares, each one forward+backward of the same loss.

All run the same GPTModel weights and the same fused attention kernel family (torch's
CPU flash kernel through SDPA or the cascade's piece calls), so ratios measure methods.

* ``naive_mb{k}``: every rollout in full, ``k`` rollouts per micro-batch (right-padded,
  gradient accumulation over the micro-batches), the causal fused SDPA kernel
  (``is_causal``, no mask tensor) of the branch-spec model's plain path, which computes
  the stock local spec's attention. ``k`` runs over 1, 2, 4 and all rollouts; the
  fastest (by median) is the reference for speed-ups (``naive_reference`` in the
  report). On a MoE model only the single batch runs (the router's load-balancing
  statistics are per batch, so micro-batches would change the loss).
* ``packed``: rollouts packed without deduplication ("remove padding").
* ``prompt_once``: prompts computed once, their K/V copied for every rollout inside
  attention (our re-implementation of Prefix Grouper's scheme; one level of sharing —
  the real ``prefix_grouper`` package is compared in :mod:`megatron_branch.commands.bench.peer`).
* ``dense_tree``: the full tree with a dense ``[U, U]`` boolean mask through torch's fused
  SDPA (on CPU the flash kernel with the mask; AReaL runs tree attention through
  FlexAttention with a block mask, which this is not).
* ``ours``: the full tree, cascade attention, one packed pass.
* ``ours_stream``: the full tree, streaming replay with the bench's chunk budget (raised
  to the largest segment where one is longer, so no segment is cut);
  ``ours_stream_small`` with an eighth of the bench's budget (many chunks: the cost per chunk).

On a Mixture-of-Experts model the naive batch masks its padding out of the router
statistics (:func:`megatron_branch.spec.moe.naive_moe_logprobs`) and the tree methods run
:func:`megatron_branch.replay_step` (streaming counts the routing in its own forwards where
its plan allows, else in a forward-only pass first: ``ours_stream_small``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from megatron_branch.commands.synthetic import RolloutBatch
from megatron_branch.flops import causal_pairs
from megatron_branch.reference.naive import batched_rollout_logprobs, naive_moe_logprobs
from megatron_branch.replay import replay_step
from megatron_branch.tree import BranchTree

# The dense baseline's [U, U] boolean mask: skip beyond this many bytes.
DENSE_MAX_SCORE_BYTES = 2 << 30


@dataclass
class Prepared:
    """A method bound to one batch: its layout's size and a step to run."""

    name: str
    kernel: str
    positions: int
    attention_pairs: int
    step: Optional[Callable[[], None]]
    skipped: str = ""
    chunk_tokens: Optional[int] = None  # streaming methods: the chunk budget
    stats: Optional[dict] = None  # streaming methods: units of the last step (chunks, stems)




def causal_logprobs(model, sequences: List[torch.Tensor], width: int) -> torch.Tensor:
    """``[r, width]`` log-probs of one right-padded micro-batch, causal attention without a
    mask tensor (fused ``is_causal`` SDPA); padding only follows each rollout's end."""
    lp = batched_rollout_logprobs(model, sequences, fused_causal=True)
    return torch.nn.functional.pad(lp, (0, width - lp.shape[1]))


def naive_micro_batches(num: int, moe: bool = False) -> List[int]:
    """Micro-batch sizes of the naive sweep (MoE: one batch only, since the router's
    load-balancing statistics are per batch and micro-batches would change the loss)."""
    if moe:
        return [num]
    # every power of two below the group and the whole group: the naive side gets its best
    return sorted({k for k in (2 ** i for i in range(num.bit_length())) if k < num} | {num})


def prepare_methods(
    models: Dict[str, torch.nn.Module],
    batch: RolloutBatch,
    loss_fn,
    chunk_tokens: int,
    names: Optional[List[str]] = None,
    dense_max_score_bytes: int = DENSE_MAX_SCORE_BYTES,
) -> List[Prepared]:
    """Bind every method to ``batch``.

    Args:
        models: ``{"cascade", "dense", "repeat_kv"}`` -> GPTModel (branch spec, one
            backend each, same weights).
        batch: the rollouts.
        loss_fn: ``(lp, rollout_ids) -> scalar``, additive over rollouts.
        chunk_tokens: the streaming budget of ``ours_stream``.
        names: a subset of methods to prepare (default: all; ``"naive"`` selects the
            whole micro-batch sweep).
        dense_max_score_bytes: ``dense_tree`` is skipped above this many mask bytes.

    Every tree method's step builds its tree (``BranchTree.from_sequences``) inside the
    timed step, as a trainer would per batch.
    """
    seqs = batch.sequences
    num = len(seqs)
    tree = BranchTree.from_sequences(seqs)
    unshared = BranchTree.from_sequences(seqs, share_limit=0)
    prompt_tree = BranchTree.from_sequences(seqs, share_limit=batch.prompt_lengths)
    lmax = max(batch.lengths)
    all_ids = torch.arange(num)

    moe = bool(getattr(models["cascade"].config, "num_moe_experts", None))
    naive_logprobs, step = (naive_moe_logprobs if moe else batched_rollout_logprobs), replay_step

    width = lmax - 1

    def naive_step(k):
        def run():
            if moe:
                loss_fn(naive_logprobs(models["cascade"], seqs, fused_causal=True), all_ids).backward()
                return
            for lo in range(0, num, k):
                ids = all_ids[lo: lo + k]
                loss_fn(causal_logprobs(models["cascade"], seqs[lo: lo + k], width), ids).backward()
        return run

    def replay(model, share_limit=None, record=None, **kw):
        tree_kw = {} if share_limit is None else {"share_limit": share_limit}

        def run():
            stats = step(model, BranchTree.from_sequences(seqs, **tree_kw), loss_fn, **kw)
            if record is not None:
                record.stats = {"chunks": stats.num_chunks, "stems": stats.num_stems}
        return run

    dense_bytes = tree.unique_positions**2  # the [U, U] boolean mask (fused SDPA keeps no score tensor)
    dense_ok = dense_bytes <= dense_max_score_bytes
    kernel = "SDPA fused is_causal (padded batch)" if moe else "SDPA fused is_causal (right-padded micro-batches)"
    methods = []
    for k in naive_micro_batches(num, moe):
        chunks = [batch.lengths[lo: lo + k] for lo in range(0, num, k)]
        positions = sum(len(c) * max(c) for c in chunks)  # padded to each micro-batch's longest
        pairs = sum(len(c) * causal_pairs(max(c)) for c in chunks)
        methods.append(Prepared(f"naive_mb{k}", f"{kernel}, {k} per micro-batch", positions, pairs, naive_step(k)))
    methods += [
        Prepared("packed", "cascade pieces (flash CPU), no sharing", unshared.unique_positions,
                 unshared.attention_pairs(), replay(models["cascade"], 0)),
        Prepared("prompt_once", "SDPA fused, prompt K/V repeated per rollout", prompt_tree.unique_positions,
                 prompt_tree.attention_pairs(), replay(models["repeat_kv"], batch.prompt_lengths)),
        Prepared("dense_tree", "SDPA fused with a dense [U, U] boolean mask", tree.unique_positions,
                 tree.unique_positions**2, replay(models["dense"]) if dense_ok else None,
                 "" if dense_ok else f"the O(U^2) mask exceeds {dense_max_score_bytes / 2**30:.2g} GiB"),
        Prepared("ours", "cascade pieces (flash CPU), one pass", tree.unique_positions,
                 tree.attention_pairs(), replay(models["cascade"])),
    ]
    # streaming at the bench's budget (at least the largest segment, so no segment is cut) and at
    # a small one (many chunks: the per-chunk cost)
    largest = max(seg.end - seg.start for seg in tree.segments)
    small = max(16, chunk_tokens // 8)
    for name, budget in (("ours_stream", max(chunk_tokens, largest)), ("ours_stream_small", small)):
        p = Prepared(name, f"cascade + prefix cache, chunks of {budget}", tree.unique_positions,
                     tree.attention_pairs(), None, chunk_tokens=budget)
        p.step = replay(models["cascade"], record=p, max_chunk_tokens=budget)
        methods.append(p)
    if names:
        methods = [m for m in methods if m.name in names or (m.name.startswith("naive_") and "naive" in names)]
    return methods
