"""The Python side of the Megatron-RL patches (``patches/megatron-lm-*``).

Megatron-RL (``train_rl.py --rl-branch-replay``) hands its trajectories over as it keeps
them: ``[N, S]`` token ids, right-padded to ``--seq-length`` with the tokenizer's pad id,
each shorter trajectory ending in ``eod``. These functions strip the padding, build the
prefix tree of the ``N`` trajectories and return log-probs in Megatron-RL's layout,
``[N, S - 1]`` with ``lp[n, t] = log p(tokens[n, t + 1] | tokens[n, :t + 1])``, in fp32,
and ``0`` past each trajectory's end (masked out by Megatron-RL's loss mask, which is 0
on padding; a finite fill keeps ``exp``/``log`` of the GRPO loss free of NaN there).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import Tensor

from megatron_branch.integrations.options import check_max_chunk_tokens, describe_budget, kernel_from_env, log_once
from megatron_branch.replay.step import replay_logprobs
from megatron_branch.scoring.logprobs import rollout_logprobs
from megatron_branch.tree import BranchTree


def trajectory_lengths(tokens: Tensor, pad_id: int, eod_id: Optional[int] = None) -> Tensor:
    """``[N]`` true lengths of right-padded trajectories ``[N, S]``.

    The trailing run of ``pad_id`` is dropped. When the pad id is the eod id (some
    tokenizers), the trajectory's own final ``eod`` is kept: Megatron-RL ends every
    trajectory shorter than ``S`` with ``eod``.

    Raises:
        ValueError: ``tokens`` is not a 2-D integer tensor with ``S >= 2``.
    """
    if tokens.dim() != 2 or tokens.shape[1] < 2 or tokens.is_floating_point():
        raise ValueError(f"tokens: expected integer token ids [N, S >= 2], got {tuple(tokens.shape)} {tokens.dtype}")
    s = tokens.shape[1]
    not_pad = (tokens != pad_id).cpu()
    # index of the last non-pad token + 1 (0 for an all-pad row)
    last = torch.where(not_pad, torch.arange(1, s + 1), torch.zeros((), dtype=torch.long)).amax(dim=1)
    if eod_id is not None and eod_id == pad_id:
        last = torch.where(last < s, last + 1, last)
    return last


def trajectory_tree(tokens: Tensor, pad_id: int, eod_id: Optional[int] = None) -> BranchTree:
    """The prefix tree of the trajectories ``[N, S]`` without their padding.

    A row of padding only (``core_v0.19.0`` pads the number of trajectories to a multiple
    of data-parallel size x micro-batch size with such rows; nothing in them is generated,
    so their loss mask is 0 throughout) is scored whole, as the stock path scores it: all
    such rows share one path of ``S`` tokens in the tree.
    """
    lengths = trajectory_lengths(tokens, pad_id, eod_id)
    lengths = torch.where(lengths == 0, tokens.shape[1], lengths)
    rows = tokens.detach().cpu()
    return BranchTree.from_sequences([rows[n, : int(lengths[n])] for n in range(rows.shape[0])])


def _as_megatron_rl(lp: Tensor, seq_length: int) -> Tensor:
    # [N, max_len - 1] -> [N, S - 1], zeros past each end
    return torch.nn.functional.pad(lp.float(), (0, seq_length - 1 - lp.shape[1]))


def replay_trajectory_logprobs(
    model, tokens: Tensor, pad_id: int, eod_id: Optional[int] = None, *, max_chunk_tokens: Optional[int] = None
) -> Tensor:
    """Old/reference-policy log-probs ``[N, S - 1]`` (fp32, no gradient) of Megatron-RL's
    trajectories, with :func:`megatron_branch.replay_logprobs` over their prefix tree.

    Args:
        model: a model chunk built with the branch spec (``Float16Module`` /
            Megatron DDP wrappers allowed).
        tokens: ``[N, S]`` right-padded token ids.
        pad_id, eod_id: the tokenizer's pad and eod ids.
        max_chunk_tokens: streaming budget per forward (``None``: one pass).
    """
    tree = trajectory_tree(tokens, pad_id, eod_id)
    lp = replay_logprobs(model, tree, max_chunk_tokens=max_chunk_tokens)
    return _as_megatron_rl(lp, tokens.shape[1]).to(tokens.device)


def trajectory_logprobs(model, tokens: Tensor, pad_id: int, eod_id: Optional[int] = None) -> Tensor:
    """Current-policy log-probs ``[N, S - 1]`` (fp32, differentiable) of Megatron-RL's
    trajectories, with :func:`megatron_branch.rollout_logprobs`: one forward over the
    micro-batch's prefix tree, the policy update's input."""
    tree = trajectory_tree(tokens, pad_id, eod_id)
    lp = rollout_logprobs(model, tree)
    return _as_megatron_rl(lp, tokens.shape[1]).to(tokens.device)


def loader_logprobs(model, data_loader: Iterable, tokenizer, *, max_chunk_tokens: Optional[int] = None) -> Tensor:
    """Old/reference-policy log-probs ``[N, S - 1]`` of every trajectory in Megatron-RL's
    log-prob data loader (``core_v0.19.0`` and later: ``compute_logprobs_batch``'s
    ``DataLoader(TensorDataset(trajs, position_ids))``), in one replay over their tree.

    The position ids are not read: an unpacked trajectory's are ``0 .. S - 1``
    (``--reset-position-ids`` is refused by :func:`validate_args`).

    Returns:
        fp32 log-probs on the trajectories' device, 0 past each end.
    """
    batches = [batch[0] for batch in data_loader]
    if not batches:
        raise ValueError("compute_logprobs_batch: the data loader holds no trajectories")
    trajs = torch.cat(batches)
    return replay_trajectory_logprobs(model, trajs, tokenizer.pad, tokenizer.eod, max_chunk_tokens=max_chunk_tokens)


# (argument, refused when, what to name): options under which the tree forward would not be
# what the stock path computes, or which Megatron-RL's tree path does not cover.
_REFUSED = (
    ("rl_use_sequence_packing", lambda v: bool(v), "--rl-use-sequence-packing (bins are built from the "
     "stock per-trajectory layout)"),
    ("pipeline_model_parallel_size", lambda v: (v or 1) > 1, "--pipeline-model-parallel-size > 1"),
    ("context_parallel_size", lambda v: (v or 1) > 1, "--context-parallel-size > 1"),
    ("reset_position_ids", lambda v: bool(v), "--reset-position-ids"),
    ("reset_attention_mask", lambda v: bool(v), "--reset-attention-mask"),
    ("attention_dropout", lambda v: bool(v), "--attention-dropout must be 0 (shared tokens would share "
     "dropout masks)"),
    ("hidden_dropout", lambda v: bool(v), "--hidden-dropout must be 0 (shared tokens would share dropout masks)"),
    ("cuda_graph_impl", lambda v: v not in (None, "none"), "--cuda-graph-impl other than none (a tree's "
     "shapes change every step; graphs are captured for the stock shapes)"),
    ("batch_invariant_mode", lambda v: bool(v), "--batch-invariant-mode (tree attention equals the stock "
     "forward to rounding, not bit for bit)"),
    ("hybrid_layer_pattern", lambda v: v is not None, "--hybrid-layer-pattern (hybrid Mamba models have no "
     "branch spec yet)"),
)


def validate_args(args) -> None:
    """Megatron-LM's ``validate_args`` for ``--rl-branch-replay`` (every patch calls it).

    Refuses what the tree path cannot compute as the stock path does, and what would cut a
    GRPO group (the answers of one prompt share their prompt only inside one tree):
    ``--grpo-prompts-per-step`` must divide over the data-parallel ranks and
    ``--micro-batch-size`` be a multiple of ``--grpo-group-size``. Options the release does
    not have are skipped. ``--rl-branch-replay-max-chunk-tokens`` (the budget of the old and
    reference log-prob replays) and ``$MEGATRON_BRANCH_KERNEL`` (the spec's kernel, read again
    when the spec is built) are checked here too; the budget in use is logged once.

    Raises:
        ValueError: ``--rl-branch-replay: ...`` naming the flag, or the bad budget or
            ``MEGATRON_BRANCH_KERNEL`` value named.
    """
    for name, refused, what in _REFUSED:
        if refused(getattr(args, name, None)):
            raise ValueError(f"--rl-branch-replay: not supported with {what}")
    dp = getattr(args, "data_parallel_size", 1) or 1
    if args.grpo_prompts_per_step % dp:
        raise ValueError(f"--rl-branch-replay: --grpo-prompts-per-step ({args.grpo_prompts_per_step}) must be "
                         f"divisible by the data-parallel size ({dp}) so that no GRPO group is split across "
                         "data-parallel ranks")
    if args.micro_batch_size % args.grpo_group_size:
        raise ValueError(f"--rl-branch-replay: --micro-batch-size ({args.micro_batch_size}) must be a multiple "
                         f"of --grpo-group-size ({args.grpo_group_size}) so that no GRPO group is split across "
                         "micro-batches")
    chunk = check_max_chunk_tokens(getattr(args, "rl_branch_replay_max_chunk_tokens", None),
                                   "--rl-branch-replay-max-chunk-tokens")
    kernel_from_env()  # fail at argument time, not at the model build
    log_once(f"megatron_branch: Megatron-RL old/reference log-probs by branch replay, {describe_budget(chunk)} "
             "(--rl-branch-replay-max-chunk-tokens)")
