"""The methods the benchmark compares, each one forward+backward of the same loss.

All run the same GPTModel weights and the same fused attention kernel family (torch's
CPU flash kernel through SDPA or the cascade's piece calls), so ratios measure methods.

* ``naive``: every rollout in full, one right-padded batch (plain trainers).
* ``packed``: rollouts packed without deduplication ("remove padding").
* ``prompt_once``: prompts computed once, their K/V copied for every rollout inside
  attention (Prefix Grouper; one level of sharing).
* ``dense_tree``: the full tree with a dense ``[U, U]`` mask (AReaL's Megatron path).
* ``ours``: the full tree, cascade attention, one packed pass.
* ``ours_stream``: the full tree, streaming replay with a bounded chunk.

On a Mixture-of-Experts model the naive batch masks its padding out of the router
statistics (:func:`megatron_branch.moe.naive_moe_logprobs`) and the tree methods run
:func:`megatron_branch.moe.replay_step` (streaming collects the router counts first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from megatron_branch.flops import causal_pairs
from megatron_branch.naive import batched_rollout_logprobs
from megatron_branch.replay import replay_step
from megatron_branch.synthetic import RolloutBatch
from megatron_branch.tree import BranchTree

# Dense scores cost heads x U^2 floats per layer (plus their gradients): skip beyond this.
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


def prepare_methods(
    models: Dict[str, torch.nn.Module],
    batch: RolloutBatch,
    loss_fn,
    chunk_tokens: int,
    names: Optional[List[str]] = None,
) -> List[Prepared]:
    """Bind every method to ``batch``.

    Args:
        models: ``{"cascade", "dense", "repeat_kv"}`` -> GPTModel (branch spec, one
            backend each, same weights).
        batch: the rollouts.
        loss_fn: ``(lp, rollout_ids) -> scalar``, additive over rollouts.
        chunk_tokens: the streaming budget of ``ours_stream``.
        names: a subset of methods to prepare (default: all).
    """
    seqs = batch.sequences
    num = len(seqs)
    tree = BranchTree.from_sequences(seqs)
    unshared = BranchTree.from_sequences(seqs, share_limit=0)
    prompt_tree = BranchTree.from_sequences(seqs, share_limit=batch.prompt_lengths)
    lmax = max(batch.lengths)
    all_ids = torch.arange(num)

    moe = bool(getattr(models["cascade"].config, "num_moe_experts", None))
    if moe:
        from megatron_branch.moe import naive_moe_logprobs as naive_logprobs
        from megatron_branch.moe import replay_step as step
    else:
        naive_logprobs, step = batched_rollout_logprobs, replay_step

    def naive():
        loss_fn(naive_logprobs(models["cascade"], seqs), all_ids).backward()

    def replay(model, t, **kw):
        return lambda: step(model, t, loss_fn, **kw)

    heads = models["dense"].config.num_attention_heads
    dense_bytes = 4 * heads * tree.unique_positions**2
    methods = [
        Prepared("naive", "SDPA fused causal (padded batch)", num * lmax, num * causal_pairs(lmax), naive),
        Prepared("packed", "cascade pieces (flash CPU), no sharing", unshared.unique_positions,
                 unshared.attention_pairs(), replay(models["cascade"], unshared)),
        Prepared("prompt_once", "SDPA fused, prompt K/V repeated per rollout", prompt_tree.unique_positions,
                 prompt_tree.attention_pairs(), replay(models["repeat_kv"], prompt_tree)),
        Prepared("dense_tree", "dense [U, U] mask, float32 softmax", tree.unique_positions,
                 tree.unique_positions**2,
                 replay(models["dense"], tree) if dense_bytes <= DENSE_MAX_SCORE_BYTES else None,
                 "" if dense_bytes <= DENSE_MAX_SCORE_BYTES else "O(U^2) scores exceed 2 GiB"),
        Prepared("ours", "cascade pieces (flash CPU), one pass", tree.unique_positions,
                 tree.attention_pairs(), replay(models["cascade"], tree)),
        Prepared("ours_stream", f"cascade + prefix cache, chunks of {chunk_tokens}", tree.unique_positions,
                 tree.attention_pairs(), replay(models["cascade"], tree, max_chunk_tokens=chunk_tokens)),
    ]
    if names:
        methods = [m for m in methods if m.name in names]
    return methods
