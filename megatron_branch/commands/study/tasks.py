"""Verifiable toy tasks for the study: prompts and a reward per rollout.

Every rollout is ``prompt | stem | tail``: tree sampling draws the response stem once per
stem and forks it into tails (:mod:`megatron_branch.commands.study.sampling`), so the stem is shared
by all tails below it. A task scores each response token as right or wrong and says how
the reward weighs them; the reward's stem and tail parts are reported separately so the
curves show *where* a mode learns.

* ``count-up`` (the task of ``examples/grpo_tree.py``): after a random prompt every response
  token should be the previous token plus one (mod vocab); the reward is the fraction that
  are. The skill is the same at every position, so a tail token teaches the stem tokens too.
* ``opener``: the prompt ends with a separator; the response must *open* with a fixed token
  (a format or plan decision, like "<think>") and then count up. Half the reward is the
  opener, half the counting. The opener is decided once, in the shared stem (its logit
  sits at the separator), and no tail token ever practises it: the credit for it can only
  reach the stem. This is where a tail-only backward (the stem a constant) cannot learn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
from torch import Tensor

TASKS: Dict[str, "Task"] = {}


def register_task(task: "Task") -> "Task":
    """Add ``task`` to :data:`TASKS` under its name."""
    TASKS[task.name] = task
    return task


def get_task(name: str) -> "Task":
    if name not in TASKS:
        raise ValueError(f"task: {name!r} is not one of {tuple(TASKS)}")
    return TASKS[name]


@dataclass(frozen=True)
class Score:
    """A rollout's reward and its parts (means over the stem's and the tail's tokens)."""

    reward: float
    stem: float
    tail: float


@dataclass(frozen=True)
class Task:
    """A verifiable task.

    Attributes:
        name: registry key (``--experiments grpo:NAME``).
        summary: one line for the report.
        make_prompt: ``(length, vocab, generator) -> [length]`` prompt tokens.
        correct: ``(sequence, prompt_len, vocab) -> [response_len]`` bool, per response token.
        weights: ``(response_len) -> [response_len]`` reward weight per response token (sums to 1).
    """

    name: str
    summary: str
    make_prompt: Callable[[int, int, torch.Generator], Tensor]
    correct: Callable[[Tensor, int, int], Tensor]
    weights: Callable[[int], Tensor]

    def prompts(self, n: int, length: int, vocab: int, generator: torch.Generator) -> List[Tensor]:
        return [self.make_prompt(length, vocab, generator) for _ in range(n)]

    def score(self, seq: Tensor, prompt_len: int, stem_len: int, vocab: int) -> Score:
        ok = self.correct(seq, prompt_len, vocab).float()  # [response_len]
        w = self.weights(ok.numel())
        return Score(float((ok * w).sum()), float(ok[:stem_len].mean()), float(ok[stem_len:].mean()))

    def rewards(self, seqs: List[Tensor], prompt_len: int, stem_len: int,
                vocab: int) -> Tuple[Tensor, Dict[str, float]]:
        """``[R]`` rewards and the batch means of the reward and its stem/tail parts."""
        scores = [self.score(s, prompt_len, stem_len, vocab) for s in seqs]
        rewards = torch.tensor([s.reward for s in scores])
        n = max(len(scores), 1)
        return rewards, {"reward": float(rewards.mean()), "reward_stem": sum(s.stem for s in scores) / n,
                         "reward_tail": sum(s.tail for s in scores) / n}


# ----------------------------------------------------------------------------- count-up
def _random_prompt(length: int, vocab: int, gen: torch.Generator) -> Tensor:
    return torch.randint(0, vocab, (length,), generator=gen)


def _count_up(seq: Tensor, prompt_len: int, vocab: int) -> Tensor:
    prev, resp = seq[prompt_len - 1:-1], seq[prompt_len:]
    return resp == (prev + 1) % vocab


def _uniform(n: int) -> Tensor:
    return torch.full((n,), 1.0 / n)


register_task(Task(
    "count-up", "each response token = previous + 1 (mod vocab); reward = fraction right",
    _random_prompt, _count_up, _uniform,
))


# ------------------------------------------------------------------------------ opener
def opener_tokens(vocab: int) -> Tuple[int, int]:
    """``(separator, opener)`` of the ``opener`` task: the last id ends every prompt; the
    response must open with ``vocab // 2``. Counting runs mod ``vocab - 1`` (the separator
    never follows), and the separator's successor under counting (1) is not the opener,
    so a tail that samples a separator never practises the opener."""
    return vocab - 1, vocab // 2


def _opener_prompt(length: int, vocab: int, gen: torch.Generator) -> Tensor:
    sep, _ = opener_tokens(vocab)
    return torch.cat([torch.randint(0, sep, (length - 1,), generator=gen), torch.tensor([sep])])


def _opener_correct(seq: Tensor, prompt_len: int, vocab: int) -> Tensor:
    _, opener = opener_tokens(vocab)
    prev, resp = seq[prompt_len - 1:-1], seq[prompt_len:]
    ok = resp == (prev + 1) % (vocab - 1)
    ok[0] = bool(resp[0] == opener)
    return ok


def _opener_weights(n: int) -> Tensor:
    w = torch.full((n,), 0.5 / max(n - 1, 1))
    w[0] = 0.5 if n > 1 else 1.0
    return w


register_task(Task(
    "opener", "prompt ends with a separator; open with a fixed token (half the reward, decided in the shared "
    "stem), then count up (mod vocab - 1)",
    _opener_prompt, _opener_correct, _opener_weights,
))
