"""The Python side of the Megatron-RL patch (``patches/megatron-lm-core_v0.16.1``).

Megatron-RL (``train_rl.py --rl-branch-replay``) hands its trajectories over as it keeps
them: ``[N, S]`` token ids, right-padded to ``--seq-length`` with the tokenizer's pad id,
each shorter trajectory ending in ``eod``. These functions strip the padding, build the
prefix tree of the ``N`` trajectories and return log-probs in Megatron-RL's layout,
``[N, S - 1]`` with ``lp[n, t] = log p(tokens[n, t + 1] | tokens[n, :t + 1])``, in fp32,
and ``0`` past each trajectory's end (masked out by Megatron-RL's loss mask, which is 0
on padding; a finite fill keeps ``exp``/``log`` of the GRPO loss free of NaN there).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

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
    """The prefix tree of the trajectories ``[N, S]`` without their padding."""
    lengths = trajectory_lengths(tokens, pad_id, eod_id)
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
