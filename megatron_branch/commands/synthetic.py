"""Synthetic branching rollouts (tree sampling) for the demo, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from megatron_branch.reference.naive import batched_rollout_logprobs
from megatron_branch.replay import replay_step


@dataclass
class RolloutBatch:
    """Rollouts with their prompt lengths and prompt (group) index."""

    sequences: List[torch.Tensor]
    prompt_lengths: List[int]
    group: List[int]

    @property
    def lengths(self) -> List[int]:
        return [int(s.numel()) for s in self.sequences]


def branching_rollouts(
    prompt_lengths: Sequence[int],
    branching: Sequence[int],
    segment_lengths: Sequence[int],
    vocab_size: int,
    seed: int = 0,
    jitter: int = 0,
) -> RolloutBatch:
    """Rollouts of a multi-level tree per prompt.

    Each prompt is followed by ``len(branching)`` levels of response segments: level
    ``l`` forks every node into ``branching[l]`` children of ``segment_lengths[l]``
    tokens (plus up to ``jitter`` random extra tokens at the last level). With
    ``branching=[16]`` this is the usual GRPO shape (G tails per prompt); ``[2, 8]`` is
    a shared response stem that forks again.

    Args:
        prompt_lengths: length of each prompt (one tree per prompt: a forest).
        branching: fan-out per level.
        segment_lengths: tokens per segment per level (same length as ``branching``).
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        seed: RNG seed.
        jitter: randomises leaf lengths by up to this many tokens.
    """
    if len(branching) != len(segment_lengths):
        raise ValueError("segment_lengths: needs one entry per level of branching")
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int) -> torch.Tensor:
        return torch.randint(0, vocab_size, (n,), generator=gen)

    seqs: List[torch.Tensor] = []
    prompts: List[int] = []
    groups: List[int] = []
    for g, plen in enumerate(prompt_lengths):
        frontier = [draw(plen)]
        for level, (fan, seg) in enumerate(zip(branching, segment_lengths)):
            last = level == len(branching) - 1
            nxt = []
            for node in frontier:
                for _ in range(fan):
                    extra = int(torch.randint(0, jitter + 1, (1,), generator=gen)) if (last and jitter) else 0
                    nxt.append(torch.cat([node, draw(seg + extra)]))
            frontier = nxt
        seqs.extend(frontier)
        prompts.extend([plen] * len(frontier))
        groups.extend([g] * len(frontier))
    return RolloutBatch(seqs, prompts, groups)


@torch.no_grad()
def sample_continuations(model, prefixes: Sequence[torch.Tensor], length: int, generator: torch.Generator,
                         vocab_size: int) -> List[torch.Tensor]:
    """Sample ``length`` tokens after each prefix from a (branch-spec or stock) GPTModel.

    A plain right-padded causal batch (no tree), for the toy RL examples; tokens are drawn
    from the softmax over the first ``vocab_size`` logits.
    """
    seqs = [p.clone() for p in prefixes]
    for _ in range(length):
        width = max(s.numel() for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : s.numel()] = s
        pos = torch.arange(width).expand(len(seqs), -1)
        logits = model(ids, pos, attention_mask=None)  # [b, s, V]
        last = torch.stack([logits[i, s.numel() - 1] for i, s in enumerate(seqs)]).float()
        nxt = torch.multinomial(torch.softmax(last[:, :vocab_size], -1), 1, generator=generator)[:, 0]
        seqs = [torch.cat([s, n.view(1)]) for s, n in zip(seqs, nxt)]
    return seqs


def policy_update(model, optimizer, sequences, loss_fn, *, naive: bool, tree=None, score_mask=None):
    """One update of the toy RL examples: ``loss_fn(lp [R, T], ids [R])`` on every rollout,
    either in full (a padded causal batch: the naive computation) or by one exact branch
    replay step over ``tree``; then the optimizer steps.

    Returns:
        ``(loss, grad_norm, seconds)``: the loss, the gradient norm before the step, and the
        time of forward, backward and step (sampling excluded).
    """
    import time

    optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if naive:
        loss = loss_fn(batched_rollout_logprobs(model, sequences), torch.arange(len(sequences)))
        loss.backward()
        value = float(loss)
    else:
        value = replay_step(model, tree, loss_fn, score_mask=score_mask).loss
    grad_norm = float(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).norm())
    optimizer.step()
    return value, grad_norm, time.perf_counter() - start
