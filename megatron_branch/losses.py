"""RL and SFT losses on per-rollout log-probs, with layout-independent aggregation.

All losses take tensors shaped like :func:`megatron_branch.rollout_logprobs` returns:
``[R, T]`` with ``T = max_len - 1`` and ``lp[r, t] = log p(token t+1 | tokens <= t)``,
plus a ``[R, T]`` mask of the positions that count (usually the response tokens).

Aggregation divides by *global* counts when they are given (``global_tokens``,
``global_seqs``), as verl's ``agg_loss`` does, so a loss summed over micro-batches,
replay chunks or data-parallel ranks equals the loss of the whole batch and the
gradient does not depend on how the batch was split. Where a call holds only part of
the batch (:func:`batch_part`, set by streaming replay for each chunk), the defaults —
this call's own counts — are refused, never silently used.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Dict, Iterator, Literal, Optional, Sequence, Tuple

import torch
from torch import Tensor

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
Metrics = Dict[str, Tensor]


# --------------------------------------------------------------- part of a batch
# (rollouts this loss call holds, rollouts of the whole batch), set by whoever calls a
# loss on part of a batch: streaming replay's chunks, the training step's micro-batches.
_PART: contextvars.ContextVar[Optional[Tuple[int, int]]] = contextvars.ContextVar("megatron_branch_loss_part",
                                                                                   default=None)


@contextlib.contextmanager
def batch_part(held: int, total: int) -> Iterator[None]:
    """Inside, loss calls hold ``held`` of the batch's ``total`` rollouts: a loss that
    would normalise by this call's own counts (no ``global_tokens`` / ``global_seqs`` /
    ``global_pairs``) raises instead of computing a layout-dependent value."""
    token = _PART.set((int(held), int(total)))
    try:
        yield
    finally:
        _PART.reset(token)


def _check_whole_batch(arg: str, what: str) -> None:
    part = _PART.get()
    if part is not None and part[0] < part[1]:
        raise ValueError(
            f"{arg}: not given, so this call would normalise by its own {what}, but it holds {part[0]} of the "
            f"batch's {part[1]} rollouts (one chunk or micro-batch of a replay step); the sum over calls would "
            f"then differ from the whole batch's loss. Pass {arg} (the whole batch's count)")


# ----------------------------------------------------------------------------- checks
def _check_2d(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected shape [R, T], got {tuple(x.shape)}")


def _check_like(name: str, x: Optional[Tensor], ref: Tensor, ref_name: str = "logprobs") -> None:
    if x is None:
        return
    if not isinstance(x, Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(
            f"{name}: shape {tuple(x.shape)} does not match {ref_name} {tuple(ref.shape)}"
        )


def _check_finite(name: str, x: Optional[Tensor], *, allow_inf: bool = False) -> None:
    """Refuse NaN (and, unless ``allow_inf``, Inf) in a loss input: one bad entry would
    turn the whole loss and every gradient into NaN, even where its mask is 0."""
    if x is None or not isinstance(x, Tensor) or not (x.is_floating_point() or x.is_complex()):
        return
    bad = torch.isnan(x) if allow_inf else ~torch.isfinite(x)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        what = "NaN" if allow_inf or bool(torch.isnan(x[bad]).any()) else "Inf"
        raise ValueError(
            f"{name}: {int(bad.sum())} {what} value(s), first at index {where}; "
            f"fix the {name} before the loss (a NaN poisons every gradient, even under a zero mask)"
        )


def _broadcast_advantages(advantages: Tensor, ref: Tensor) -> Tensor:
    if not isinstance(advantages, Tensor):
        raise ValueError(f"advantages: expected a tensor, got {type(advantages).__name__}")
    num, width = ref.shape
    if advantages.dim() == 1 and advantages.shape[0] == num:
        return advantages[:, None].expand(num, width)
    if advantages.dim() == 2 and advantages.shape[0] == num and advantages.shape[1] in (1, width):
        return advantages.expand(num, width)
    raise ValueError(
        f"advantages: shape {tuple(advantages.shape)} does not match logprobs {tuple(ref.shape)} "
        f"(expected [{num}], [{num}, 1] or [{num}, {width}])"
    )


# ------------------------------------------------------------------------ aggregation
def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: AggMode = "token-mean",
    *,
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
) -> Tensor:
    """Aggregate a per-token loss ``[R, T]`` into a scalar.

    Modes:
        * ``token-mean``: ``sum(loss * mask) / global_tokens`` (DAPO's token-level mean).
        * ``seq-mean-token-sum``: ``sum(loss * mask) / global_seqs``.
        * ``seq-mean-token-mean``: ``sum_r mean_t(loss[r] over mask[r]) / global_seqs``
          (the GRPO paper's sample-level mean).

    Args:
        loss_mat: ``[R, T]`` per-token loss.
        mask: ``[R, T]`` 0/1 (or bool) weights.
        mode: one of :data:`AGG_MODES`.
        global_tokens: total mask sum over the whole batch (all chunks/ranks); default:
            this call's ``mask.sum()``.
        global_seqs: number of sequences in the whole batch; default: ``R``.

    Raises:
        ValueError: inside :func:`batch_part` (a replay chunk holding part of the
            batch), the default normaliser of ``mode`` would be this call's own count:
            the argument to pass is named.

    Returns:
        A scalar tensor; summing it over a partition of the batch (with the same global
        counts) gives the whole batch's value.
    """
    _check_2d("loss", loss_mat)
    _check_like("mask", mask, loss_mat, "loss")
    _check_finite("mask", mask)
    if mode not in AGG_MODES:
        raise ValueError(f"mode: {mode!r} is not one of {AGG_MODES}")
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        if global_tokens is None:
            _check_whole_batch("global_tokens", "mask sum")
        denom = global_tokens if global_tokens is not None else mask.sum().clamp(min=1.0)
        return (loss_mat * mask).sum() / denom
    if global_seqs is None:
        _check_whole_batch("global_seqs", "number of sequences")
    denom = global_seqs if global_seqs is not None else loss_mat.shape[0]
    per_seq = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / denom


# ----------------------------------------------------------------------------- helpers
def response_mask(lengths: Sequence[int] | Tensor, prompt_lengths: Sequence[int] | Tensor, *,
                  device=None) -> Tensor:
    """``[R, max_len - 1]`` float mask of the positions that predict a response token.

    Position ``t`` predicts token ``t + 1``; it counts when
    ``prompt_len[r] <= t + 1 < len[r]``. Built on the host; ``device`` moves the result
    (e.g. the model's).

    Raises:
        ValueError: the two lengths lists differ in size, or a prompt is not shorter than
            its rollout.
    """
    host = torch.device("cpu")  # lengths are host bookkeeping
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=host)
    prompt_lengths = torch.as_tensor(prompt_lengths, dtype=torch.long, device=host)
    if lengths.shape != prompt_lengths.shape:
        raise ValueError(
            f"prompt_lengths: {prompt_lengths.numel()} entries for {lengths.numel()} rollouts"
        )
    bad = ((prompt_lengths < 1) | (prompt_lengths >= lengths)).nonzero()
    if bad.numel():
        r = int(bad[0])
        raise ValueError(
            f"rollout {r}: prompt_lengths {int(prompt_lengths[r])} must be in [1, {int(lengths[r])})"
        )
    nxt = torch.arange(1, int(lengths.max()), device=host)[None, :]
    mask = ((nxt >= prompt_lengths[:, None]) & (nxt < lengths[:, None])).float()
    return mask if device is None else mask.to(device)


def sequence_logprobs(logprobs: Tensor, mask: Tensor) -> Tensor:
    """``[R]`` sum of the masked per-token log-probs of each rollout."""
    _check_2d("logprobs", logprobs)
    _check_like("mask", mask, logprobs)
    _check_finite("mask", mask)
    return (logprobs * mask.to(logprobs.dtype)).sum(-1)


def grpo_advantages(
    rewards: Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages (Shao et al. 2024, DeepSeekMath / GRPO).

    Args:
        rewards: ``[R]`` scalar rewards, groups of ``group_size`` consecutive rollouts.
        group_size: rollouts per prompt ``G``.
        normalize_std: divide by the group's standard deviation (Dr. GRPO turns it off).

    Returns:
        ``[R]`` advantages ``(r - mean_g) / (std_g + eps)``.
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D tensor [R], got {getattr(rewards, 'shape', rewards)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size: {group_size} does not divide {rewards.numel()} rewards")
    _check_finite("rewards", rewards)
    grouped = rewards.float().view(-1, group_size)
    adv = grouped - grouped.mean(-1, keepdim=True)
    if normalize_std:
        std = grouped.std(-1, keepdim=True) if group_size > 1 else torch.zeros_like(adv[:, :1])
        adv = adv / (std + eps)
    return adv.view(-1)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL estimate to a reference policy (Schulman's k1/k2/k3 estimators).

    ``k3 = exp(ref - lp) - (ref - lp) - 1`` is unbiased and non-negative (GRPO's choice).
    """
    _check_like("ref_logprobs", ref_logprobs, logprobs)
    delta = ref_logprobs - logprobs
    if kind == "k1":
        return -delta
    if kind == "k2":
        return 0.5 * delta.square()
    if kind == "k3":
        return delta.clamp(-20.0, 20.0).exp() - delta - 1.0
    raise ValueError(f"kind: {kind!r} is not one of ('k1', 'k2', 'k3')")


# ----------------------------------------------------------------------- policy losses
POLICY_LOSSES: Dict[str, Callable[..., Tuple[Tensor, Metrics]]] = {}


def register_policy_loss(name: str):
    """Register a policy loss under ``name`` in :data:`POLICY_LOSSES`."""

    def wrap(fn):
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


def get_policy_loss(name: str) -> Callable[..., Tuple[Tensor, Metrics]]:
    """The registered policy loss ``name``."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy loss: {name!r} is not one of {tuple(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


@register_policy_loss("ppo")
def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: Optional[float] = None,
    clip_ratio_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    ref_logprobs: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    agg: AggMode = "token-mean",
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
) -> Tuple[Tensor, Metrics]:
    """Clipped-surrogate policy loss (Schulman et al. 2017, PPO), with options.

    ``ratio = exp(lp - old_lp)``; per token ``-min(ratio * A, clip(ratio, 1 - lo, 1 + hi) * A)``.
    Dual-clip (Ye et al. 2020) caps the loss of negative advantages at ``-dual_clip * A``.
    ``kl_coef > 0`` adds a KL-to-reference penalty per token (GRPO's k3 by default).

    Args:
        logprobs: ``[R, T]`` current log-probs (differentiable).
        old_logprobs: ``[R, T]`` behaviour-policy log-probs.
        advantages: ``[R]``, ``[R, 1]`` or ``[R, T]``.
        mask: ``[R, T]`` positions that count.
        clip_ratio: symmetric clip ``eps``; ``clip_ratio_low``/``clip_ratio_high`` override
            each side (DAPO's clip-higher).
        dual_clip: the dual-clip constant ``c > 1``, or None.
        ref_logprobs: ``[R, T]`` reference-policy log-probs for the KL term.
        kl_coef: weight of the KL term.
        agg, global_tokens, global_seqs: see :func:`agg_loss`.

    Returns:
        ``(loss, metrics)``: a scalar and detached diagnostics (clip fraction, KL).
    """
    _check_2d("logprobs", logprobs)
    _check_like("old_logprobs", old_logprobs, logprobs)
    _check_like("mask", mask, logprobs)
    _check_like("ref_logprobs", ref_logprobs, logprobs)
    _check_finite("advantages", advantages)
    _check_finite("mask", mask)
    _check_finite("old_logprobs", old_logprobs, allow_inf=True)
    _check_finite("ref_logprobs", ref_logprobs if kl_coef else None, allow_inf=True)
    adv = _broadcast_advantages(advantages, logprobs).to(logprobs.dtype)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip: must be > 1, got {dual_clip}")
    if kl_coef and ref_logprobs is None:
        raise ValueError("ref_logprobs: required when kl_coef > 0")
    lo = clip_ratio if clip_ratio_low is None else clip_ratio_low
    hi = clip_ratio if clip_ratio_high is None else clip_ratio_high
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))
    surr1 = -adv * ratio
    surr2 = -adv * ratio.clamp(1.0 - lo, 1.0 + hi)
    per_token = torch.maximum(surr1, surr2)
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * dual_clip), per_token)
    metrics: Metrics = {}
    m = mask.to(logprobs.dtype)
    with torch.no_grad():
        metrics["clip_frac"] = ((surr2 > surr1).to(m.dtype) * m).sum() / m.sum().clamp(min=1.0)
    if kl_coef:
        kl = kl_penalty(logprobs, ref_logprobs, kl_kind)
        per_token = per_token + kl_coef * kl
        with torch.no_grad():
            metrics["kl"] = (kl * m).sum() / m.sum().clamp(min=1.0)
    loss = agg_loss(per_token, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs)
    return loss, metrics


@register_policy_loss("grpo")
def grpo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logprobs: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    clip_ratio: float = 0.2,
    agg: AggMode = "seq-mean-token-mean",
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
) -> Tuple[Tensor, Metrics]:
    """GRPO (Shao et al. 2024): PPO clip with group-relative advantages
    (:func:`grpo_advantages`), a k3 KL to the reference, and a per-sequence mean."""
    return ppo_policy_loss(
        logprobs, old_logprobs, advantages, mask, clip_ratio=clip_ratio,
        ref_logprobs=ref_logprobs, kl_coef=kl_coef, agg=agg,
        global_tokens=global_tokens, global_seqs=global_seqs,
    )


@register_policy_loss("dapo")
def dapo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    global_tokens: Optional[float] = None,
) -> Tuple[Tensor, Metrics]:
    """DAPO (Yu et al. 2025): clip-higher and token-level aggregation, no KL term."""
    return ppo_policy_loss(
        logprobs, old_logprobs, advantages, mask, clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high, agg="token-mean", global_tokens=global_tokens,
    )


# ------------------------------------------------------------------------- DPO and SFT
def dpo_loss(
    chosen_logprobs: Tensor,
    rejected_logprobs: Tensor,
    ref_chosen_logprobs: Tensor,
    ref_rejected_logprobs: Tensor,
    *,
    beta: float = 0.1,
    global_pairs: Optional[float] = None,
) -> Tuple[Tensor, Metrics]:
    """Sigmoid DPO loss (Rafailov et al. 2023).

    Args:
        chosen_logprobs, rejected_logprobs: ``[P]`` summed response log-probs of each
            pair's chosen and rejected rollouts (see :func:`sequence_logprobs`).
        ref_chosen_logprobs, ref_rejected_logprobs: ``[P]`` the same under the reference.
        beta: inverse temperature.
        global_pairs: number of pairs in the whole batch (default ``P``).

    Returns:
        ``(loss, metrics)``: ``sum(-logsigmoid(beta * margin)) / global_pairs``.
    """
    if not isinstance(chosen_logprobs, Tensor) or chosen_logprobs.dim() != 1:
        raise ValueError(
            f"chosen_logprobs: expected a 1-D tensor [P], got {getattr(chosen_logprobs, 'shape', None)}"
        )
    for name, x in (
        ("rejected_logprobs", rejected_logprobs),
        ("ref_chosen_logprobs", ref_chosen_logprobs),
        ("ref_rejected_logprobs", ref_rejected_logprobs),
    ):
        _check_like(name, x, chosen_logprobs, "chosen_logprobs")
    margin = (chosen_logprobs - ref_chosen_logprobs) - (rejected_logprobs - ref_rejected_logprobs)
    if global_pairs is None:
        _check_whole_batch("global_pairs", "number of pairs")
    denom = global_pairs if global_pairs is not None else chosen_logprobs.numel()
    loss = -torch.nn.functional.logsigmoid(beta * margin).sum() / denom
    with torch.no_grad():
        metrics = {"reward_accuracy": (margin > 0).float().mean(), "margin": margin.mean()}
    return loss, metrics


def sft_loss(
    logprobs: Tensor,
    mask: Tensor,
    *,
    agg: AggMode = "token-mean",
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
) -> Tensor:
    """Supervised fine-tuning cross-entropy: the aggregated ``-logprobs`` over ``mask``."""
    _check_2d("logprobs", logprobs)
    _check_like("mask", mask, logprobs)
    return agg_loss(-logprobs, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs)
