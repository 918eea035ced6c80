"""The study's training algorithms, in a registry: GRPO, PPO and DPO on tree samples.

An algorithm turns one step's :class:`~megatron_branch.commands.study.sampling.TreeSample` and
rewards into a :class:`Prepared` update: the rollouts to train on, the response mask, the
rollout groups whose loss must be evaluated together, what extra log-probs it needs
(``"old"``: the sampling policy's, ``"ref"``: the frozen reference's) and a loss
``loss_fn(lp [r, T], ids [r]) -> scalar`` that is additive over any split of the
rollouts (global counts), so one function serves the naive batch, one replay pass and
every streaming chunk alike.

* ``grpo`` (Shao et al. 2024): sequence-level group-relative advantages over all rollouts
  of a prompt, one on-policy update per batch, per-sequence mean
  (``mb.losses`` ``grpo`` policy loss).
* ``ppo`` (Schulman et al. 2017) with a **value-free tree baseline** and ``ppo_epochs``
  clipped updates per batch against the sampling policy's log-probs. A stem's value is the
  mean reward of the tails below it and a prompt's value the mean of its rollouts (Monte
  Carlo values read off the sampled tree, as tree-search RL methods do), so per token:
  stem tokens get ``V(stem) - V(prompt)``, tail tokens ``R - V(stem)``, both divided by the
  prompt's reward std. Why not a critic: branch replay hands the loss per-token log-probs,
  not hidden states, so a token-level value head would need a second forward path outside
  the exactness guarantee (a library change); a learned critic on a 2-layer toy policy
  would also mostly add its own noise; and the tree already gives an unbiased per-segment
  baseline for free.
* ``dpo`` (Rafailov et al. 2023), online: each prompt gets one response stem forked into
  exactly two tails, so a pair shares the prompt *and* the response stem; the higher-reward tail is chosen (ties
  dropped), the reference is the initial policy, sigmoid loss with ``dpo_beta``. The stem's
  log-probs cancel in the pair's log-ratio, but its activations still carry gradient
  through attention, and the first token after the fork is scored at the stem's last
  position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Literal, Optional

import torch
from torch import Tensor

from megatron_branch import losses
from megatron_branch.commands.study.sampling import TreeSample

Needs = Optional[Literal["old", "ref"]]


class StepLoss:
    """``loss_fn(lp [r, T], ids [r]) -> scalar`` with per-call metrics collected.

    Subclasses implement :meth:`compute` returning ``(loss, metrics)``; metric values are
    summed over calls with their weight (``metrics[k] = (sum, count)``).
    """

    def __init__(self):
        self.sums: Dict[str, List[float]] = {}

    def reset(self) -> None:
        self.sums = {}

    def __call__(self, lp: Tensor, ids: Tensor) -> Tensor:
        loss, metrics = self.compute(lp, ids.to(torch.long))
        for key, (total, count) in metrics.items():
            acc = self.sums.setdefault(key, [0.0, 0.0])
            acc[0] += float(total)
            acc[1] += float(count)
        return loss

    def compute(self, lp: Tensor, ids: Tensor):
        raise NotImplementedError

    def summary(self) -> Dict[str, float]:
        return {k: s / c for k, (s, c) in self.sums.items() if c}


@dataclass
class Prepared:
    """One step's update as an algorithm hands it to the trainer.

    Attributes:
        sequences: the rollouts to train on.
        score_mask: ``[R, max_len - 1]`` response mask (the loss reads only these log-probs).
        make_loss: ``extra -> StepLoss`` where ``extra`` is ``[R, max_len - 1]`` old or
            reference log-probs (``needs``), else None.
        needs: ``"old"``, ``"ref"`` or None.
        epochs: optimizer updates on this batch.
        group_ids: ``[R]``; equal ids reach ``loss_fn`` together (DPO pairs), or None.
        info: per-step numbers for the record (e.g. ``dpo_pairs``).
    """

    sequences: List[Tensor]
    score_mask: Optional[Tensor]
    make_loss: Callable[[Optional[Tensor]], StepLoss]
    needs: Needs = None
    epochs: int = 1
    group_ids: Optional[List[int]] = None
    info: Dict[str, float] = field(default_factory=dict)


class Algo:
    """Base class: ``prepare(sample, rewards, cfg) -> Prepared``.

    ``tails`` forces the number of tails per stem (DPO: 2), None keeps the config's.
    """

    name = ""
    tails: Optional[int] = None

    def prepare(self, sample: TreeSample, rewards: Tensor, cfg) -> Prepared:
        raise NotImplementedError


ALGOS: Dict[str, Algo] = {}


def register_algo(cls):
    """Register an :class:`Algo` subclass (an instance) under ``cls.name``."""
    ALGOS[cls.name] = cls()
    return cls


def get_algo(name: str) -> Algo:
    if name not in ALGOS:
        raise ValueError(f"algo: {name!r} is not one of {tuple(ALGOS)}")
    return ALGOS[name]


def _response_mask(seqs: List[Tensor], prompt_len: int) -> Tensor:
    return losses.response_mask([s.numel() for s in seqs], [prompt_len] * len(seqs))


# ------------------------------------------------------------------------------- GRPO
class _GRPOLoss(StepLoss):
    def __init__(self, adv: Tensor, mask: Tensor):
        super().__init__()
        self.adv, self.mask, self.num = adv, mask, mask.shape[0]

    def compute(self, lp, ids):
        loss, _ = losses.get_policy_loss("grpo")(
            lp, lp.detach(), self.adv[ids], self.mask[ids], agg="seq-mean-token-mean", global_seqs=self.num)
        return loss, {}


@register_algo
class GRPO(Algo):
    """Group-relative advantages over the ``stems x tails`` rollouts of each prompt."""

    name = "grpo"

    def prepare(self, sample, rewards, cfg):
        adv = losses.grpo_advantages(rewards, sample.group_size)
        mask = _response_mask(sample.sequences, sample.prompt_len)
        return Prepared(sample.sequences, mask, lambda _: _GRPOLoss(adv, mask))


# -------------------------------------------------------------------------------- PPO
def tree_advantages(sample: TreeSample, rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """``[R, max_len - 1]`` per-token advantages from the tree's Monte Carlo values.

    Stem tokens: ``(V(stem) - V(prompt)) / std``; tail tokens: ``(R - V(stem)) / std``, where
    ``V`` is the mean reward of the rollouts below a node and ``std`` the reward std of the
    prompt's rollouts; 0 on the prompt. Entry ``t`` is the advantage of token ``t + 1``.
    """
    r = rewards.float().view(sample.num_prompts, sample.stems, sample.tails)
    v_stem = r.mean(-1, keepdim=True)  # [P, k, 1]
    v_prompt = r.mean((-1, -2), keepdim=True)  # [P, 1, 1]
    scale = r.view(sample.num_prompts, -1).std(-1).view(-1, 1, 1) + eps if sample.group_size > 1 else 1.0
    stem_adv = ((v_stem - v_prompt) / scale).expand_as(r).reshape(-1)  # [R]
    tail_adv = ((r - v_stem) / scale).reshape(-1)  # [R]
    width = max(s.numel() for s in sample.sequences) - 1
    token = torch.arange(1, width + 1)  # token index predicted at entry t
    in_stem = (token >= sample.prompt_len) & (token < sample.prompt_len + sample.stem_len)
    adv = torch.where(in_stem[None, :], stem_adv[:, None], tail_adv[:, None])
    return adv * (token >= sample.prompt_len).to(adv.dtype)[None, :]  # 0 on the prompt


class _PPOLoss(StepLoss):
    def __init__(self, old: Tensor, adv: Tensor, mask: Tensor, clip: float):
        super().__init__()
        self.old, self.adv, self.mask, self.clip = old, adv, mask, clip
        self.tokens = float(mask.sum())

    def compute(self, lp, ids):
        mask = self.mask[ids]
        loss, metrics = losses.get_policy_loss("ppo")(
            lp, self.old[ids].to(lp.device), self.adv[ids].to(lp.dtype), mask, clip_ratio=self.clip,
            agg="token-mean", global_tokens=self.tokens)
        return loss, {"clip_frac": (float(metrics["clip_frac"]) * float(mask.sum()), float(mask.sum()))}


@register_algo
class PPO(Algo):
    """Clipped PPO, ``ppo_epochs`` updates per batch, tree-baseline per-token advantages."""

    name = "ppo"

    def prepare(self, sample, rewards, cfg):
        adv = tree_advantages(sample, rewards)
        mask = _response_mask(sample.sequences, sample.prompt_len)
        return Prepared(sample.sequences, mask, lambda old: _PPOLoss(old, adv, mask, cfg.clip_ratio),
                        needs="old", epochs=cfg.ppo_epochs)


# -------------------------------------------------------------------------------- DPO
class _DPOLoss(StepLoss):
    """Rollouts ``2i`` (chosen) and ``2i + 1`` (rejected) form pair ``i``."""

    def __init__(self, ref: Tensor, mask: Tensor, beta: float):
        super().__init__()
        self.ref, self.mask, self.beta = ref, mask, beta
        self.pairs = mask.shape[0] // 2

    def compute(self, lp, ids):
        order = torch.argsort(ids)
        ids, lp = ids[order], lp[order.to(lp.device)]
        if ids.numel() % 2 or not (torch.equal(ids[0::2] % 2, torch.zeros_like(ids[0::2]))
                                    and torch.equal(ids[1::2], ids[0::2] + 1)):
            raise ValueError(f"dpo: loss_fn got incomplete pairs {ids.tolist()} (group_ids must keep pairs)")
        mask = self.mask[ids].to(lp.device)
        seq = losses.sequence_logprobs(lp, mask)  # [r]
        ref = losses.sequence_logprobs(self.ref[ids].to(lp.device), mask)
        loss, _ = losses.dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta=self.beta,
                                  global_pairs=self.pairs)
        with torch.no_grad():
            margin = (seq[0::2] - ref[0::2]) - (seq[1::2] - ref[1::2])
        n = margin.numel()
        return loss, {"dpo_margin": (float(margin.sum()), n), "dpo_accuracy": (float((margin > 0).sum()), n)}


def preference_pairs(sample: TreeSample, rewards: Tensor):
    """``(sequences, group_ids)``: each stem's two tails as (chosen, rejected), ties dropped."""
    if sample.tails != 2:
        raise ValueError(f"dpo: needs exactly 2 tails per stem (a pair), got {sample.tails}")
    seqs, groups = [], []
    for g in range(len(sample.sequences) // 2):
        a, b = 2 * g, 2 * g + 1
        if float(rewards[a]) == float(rewards[b]):
            continue
        chosen, rejected = (a, b) if rewards[a] > rewards[b] else (b, a)
        seqs += [sample.sequences[chosen], sample.sequences[rejected]]
        groups += [len(groups) // 2] * 2
    return seqs, groups


@register_algo
class DPO(Algo):
    """Online DPO on pairs that share the prompt and the response stem."""

    name = "dpo"
    tails = 2

    def prepare(self, sample, rewards, cfg):
        seqs, groups = preference_pairs(sample, rewards)
        mask = _response_mask(seqs, sample.prompt_len) if seqs else None
        return Prepared(seqs, mask, lambda ref: _DPOLoss(ref, mask, cfg.dpo_beta), needs="ref",
                        group_ids=groups, info={"dpo_pairs": len(groups) // 2})
