"""Multi-turn (agentic) rollouts: a prompt, then turns of policy output and of tool or
environment text, branching at every turn.

Only the policy's tokens enter the loss; tool results and environment text are context.
:func:`assemble` turns rollouts given as turns into token sequences with a per-token loss
mask and turn index, :class:`AgenticBatch.tree` packs them (the mask travels with the
tree, :attr:`megatron_branch.tree.BranchTree.loss_mask`), and
:meth:`AgenticBatch.token_advantages` spreads per-turn advantages over each turn's tokens
— the ``[R, max_len - 1]`` tensors every loss in :mod:`megatron_branch.losses` takes.

    batch = assemble([[Turn(prompt, "prompt"), Turn(call, "policy"), Turn(result, "tool"),
                       Turn(answer, "policy")], ...])
    tree = batch.tree()
    mask = tree.rollout_loss_mask()            # policy tokens only
    adv = batch.token_advantages(turn_adv)     # [R, turns] -> [R, max_len - 1]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Literal, Optional, Sequence

import torch
from torch import Tensor

from megatron_branch import losses
from megatron_branch.tree import BranchTree

Role = Literal["prompt", "policy", "tool"]
ROLES = ("prompt", "policy", "tool")


@dataclass(frozen=True)
class Turn:
    """One turn of a rollout: its tokens and who produced them (``"prompt"``,
    ``"policy"`` — the only role whose log-probs are trained — or ``"tool"`` for tool
    results and environment text)."""

    tokens: Sequence[int]
    role: Role


@dataclass
class AgenticBatch:
    """Rollouts as token sequences with per-token loss masks and turn indices.

    Attributes:
        sequences: ``R`` LongTensors.
        loss_masks: ``R`` bool tensors, True on the policy's tokens.
        turns: ``R`` LongTensors, the turn index of every token.
        num_turns: ``[R]`` turns per rollout.
    """

    sequences: List[Tensor]
    loss_masks: List[Tensor]
    turns: List[Tensor]
    num_turns: List[int]

    def tree(self, vocab_size: Optional[int] = None) -> BranchTree:
        """The packed tree, with the loss masks (shared turns agree by construction)."""
        return BranchTree.from_sequences(self.sequences, vocab_size=vocab_size, loss_masks=self.loss_masks)

    def token_advantages(self, turn_advantages: Tensor) -> Tensor:
        """``[R, max_len - 1]`` advantages: ``adv[r, t]`` is the advantage of the turn that
        token ``t + 1`` of rollout ``r`` belongs to (0 past the end).

        Args:
            turn_advantages: ``[R, T]`` with ``T`` at least the most turns of a rollout.

        Raises:
            ValueError: the shape does not cover every rollout's turns.
        """
        r, width = len(self.sequences), max(s.numel() for s in self.sequences) - 1
        if turn_advantages.dim() != 2 or turn_advantages.shape[0] != r or turn_advantages.shape[1] < max(
                self.num_turns):
            raise ValueError(f"turn_advantages: expected [{r}, >= {max(self.num_turns)}] (rollouts, turns), "
                             f"got {tuple(turn_advantages.shape)}")
        out = torch.zeros(r, width, dtype=turn_advantages.dtype)
        for i, turns in enumerate(self.turns):
            out[i, : turns.numel() - 1] = turn_advantages[i, turns[1:]]
        return out


def assemble(rollouts: Sequence[Sequence[Turn]]) -> AgenticBatch:
    """Token sequences, loss masks and turn indices of multi-turn rollouts.

    Raises:
        ValueError: no rollouts, a rollout without turns, an empty turn, an unknown role,
            or a rollout whose first token is policy output (it has no context); the
            message names the rollout and turn.
    """
    if not rollouts:
        raise ValueError("rollouts: none given")
    sequences, masks, turns, counts = [], [], [], []
    for r, rollout in enumerate(rollouts):
        if not rollout:
            raise ValueError(f"rollout {r}: has no turns")
        toks, mask, idx = [], [], []
        for t, turn in enumerate(rollout):
            if turn.role not in ROLES:
                raise ValueError(f"rollout {r}, turn {t}: role {turn.role!r} is not one of {ROLES}")
            ids = torch.as_tensor(turn.tokens, dtype=torch.long).reshape(-1)
            if ids.numel() == 0:
                raise ValueError(f"rollout {r}, turn {t}: the turn is empty")
            toks.append(ids)
            mask.append(torch.full((ids.numel(),), turn.role == "policy"))
            idx.append(torch.full((ids.numel(),), t, dtype=torch.long))
        if rollout[0].role == "policy":
            raise ValueError(f"rollout {r}, turn 0: a rollout cannot start with policy output (no context)")
        sequences.append(torch.cat(toks))
        masks.append(torch.cat(mask))
        turns.append(torch.cat(idx))
        counts.append(len(rollout))
    return AgenticBatch(sequences, masks, turns, counts)


def group_turn_advantages(turn_rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """Per-turn GRPO advantages: each turn's reward normalised within its group (the
    rollouts of one prompt) at the same turn index.

    Args:
        turn_rewards: ``[R, T]`` reward of each rollout's turns (consecutive groups of
            ``group_size`` rollouts).

    Raises:
        ValueError: ``group_size`` does not divide ``R``.
    """
    if turn_rewards.dim() != 2 or group_size < 1 or turn_rewards.shape[0] % group_size:
        raise ValueError(f"group_size: {group_size} does not divide the {turn_rewards.shape[0]} rollouts of "
                         f"turn_rewards {tuple(turn_rewards.shape)}")
    turns = turn_rewards.shape[1]
    per_turn = losses.grpo_advantages(turn_rewards.t().reshape(-1), group_size, eps=eps)  # turn-major
    return per_turn.view(turns, -1).t()
