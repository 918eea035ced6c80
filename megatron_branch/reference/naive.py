"""The naive computation: every rollout through the model separately.

This is the truth every mode is judged against (DESIGN.md §5): use it with a GPTModel
built from Megatron's *stock* local spec. :func:`naive_rollout_logprobs` runs each
rollout alone with an explicit causal mask; :func:`batched_rollout_logprobs` runs them
as one right-padded batch, as plain trainers do (the timed baseline);
:func:`naive_moe_logprobs` is the naive MoE batch (padding kept out of the router
statistics); :func:`make_naive_forward_step` is the naive truth as a Megatron forward step.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from megatron_branch._megatron import TopKRouter, replaying_topk, vocab_parallel_cross_entropy
from megatron_branch.scoring.temperature import Temperatures


def _as_list(sequences) -> List[Tensor]:
    return [torch.as_tensor(s, dtype=torch.long) for s in sequences]


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """``log_softmax(logits)[targets]`` of batch-first ``[b, s, V / tp]`` logits (vocab-parallel), ``[b, s]``."""
    # logits [b, s, V/tp], targets [b, s] -> [b, s] via Megatron's [s, b, V] convention
    nll = vocab_parallel_cross_entropy(logits.float().transpose(0, 1).contiguous(), targets.t().contiguous())
    return -nll.t()


def _per_rollout_temperature(temperature, num: int) -> Tensor:
    """``[R]`` float temperatures (validated like the tree path's)."""
    temps = Temperatures.of(temperature, num)
    return temps.values[temps.column]


def naive_rollout_logprobs(model, sequences: Sequence, temperature=None) -> Tensor:
    """``[R, max_len - 1]`` log-probs, each rollout run alone with a causal mask; with a
    ``temperature`` (one number or one per rollout), of ``log_softmax(logits / T)``."""
    seqs = _as_list(sequences)
    temps = _per_rollout_temperature(temperature, len(seqs))
    device = next(model.parameters()).device
    width = max(s.numel() for s in seqs) - 1
    rows = []
    for r, s in enumerate(seqs):
        n = s.numel()
        ids = s.to(device).unsqueeze(0)
        pos = torch.arange(n, device=device).unsqueeze(0)
        # Megatron convention: True = masked out; [1, 1, n, n]
        mask = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)[None, None]
        logits = model(ids, pos, attention_mask=mask)
        t = float(temps[r])
        lp = token_logprobs(logits[:, :-1] / t if t != 1.0 else logits[:, :-1], ids[:, 1:])[0]
        rows.append(torch.nn.functional.pad(lp, (0, width - lp.numel())))
    return torch.stack(rows)


def batched_rollout_logprobs(model, sequences: Sequence, multiple: int = 1, *, fused_causal: bool = False,
                             temperature=None) -> Tensor:
    """``[R, max_len - 1]`` log-probs from one right-padded batch (causal attention).

    Padding sits after each rollout's end, so with causal attention it never influences
    a real token; its log-probs are zeroed. ``multiple`` pads the batch width further
    (Transformer Engine's FP8 GEMMs need token counts divisible by 16). ``fused_causal``
    passes no mask tensor, so the layer's own causal mask type applies: on the branch spec
    that is torch's fused ``is_causal`` SDPA, the kernel family of the tree path (the
    fair naive of the benchmarks); the default explicit ``[w, w]`` mask is what the stock
    local spec needs. ``temperature``: one number or one per rollout (``logits / T``).
    """
    seqs = _as_list(sequences)
    temps = _per_rollout_temperature(temperature, len(seqs))
    device = next(model.parameters()).device
    lengths = torch.tensor([s.numel() for s in seqs], device=device)
    max_len = int(lengths.max())
    width = -(-max_len // multiple) * multiple
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, : s.numel()] = s.to(device)
    pos = torch.arange(width, device=device).unsqueeze(0).expand(len(seqs), -1)
    mask = None if fused_causal else torch.ones(width, width, dtype=torch.bool, device=device).triu(1)[None, None]
    logits = model(ids, pos, attention_mask=mask)[:, : max_len - 1]
    if not bool((temps == 1.0).all()):
        logits = logits / temps.to(logits.device, logits.dtype)[:, None, None]
    lp = token_logprobs(logits, ids[:, 1:max_len])
    valid = torch.arange(1, max_len, device=device)[None, :] < lengths[:, None]
    return torch.where(valid, lp, torch.zeros((), device=device))


def make_naive_forward_step(loss_fn, sequences: Sequence, forward_only: bool = False, temperature=None):
    """The naive truth as a Megatron ``forward_step_func``: each micro-batch's rollouts as one
    right-padded causal batch through a stock-spec model (every rollout its own sequence).

    The data iterator yields :class:`~megatron_branch.training.batching.TreeMicroBatch`
    (only ``rollouts`` and ``width`` are used, so the naive run sees exactly the same
    micro-batches as branch replay). ``loss_fn`` is the branch-replay one:
    ``(lp [r, width], rollout_ids [r]) -> (loss_sum, num_tokens)``. Pipeline size 1.
    ``temperature``: one number or one per rollout of ``sequences``.
    """
    seqs = _as_list(sequences)
    temps = _per_rollout_temperature(temperature, len(seqs))

    def forward_step(data_iterator, model):
        item = next(data_iterator)
        ids_r = item.rollouts
        device = next(model.parameters()).device
        lengths = torch.tensor([seqs[int(r)].numel() for r in ids_r], device=device)
        width = int(lengths.max())
        ids = torch.zeros(len(ids_r), width, dtype=torch.long, device=device)
        for i, r in enumerate(ids_r):
            ids[i, : lengths[i]] = seqs[int(r)].to(device)
        pos = torch.arange(width, device=device).unsqueeze(0).expand(len(ids_r), -1)
        mask = torch.ones(width, width, dtype=torch.bool, device=device).triu(1)[None, None]
        output = model(ids, pos, attention_mask=mask)

        def loss_func(logits: Tensor):
            t = temps[torch.as_tensor(ids_r, dtype=torch.long, device=temps.device)].to(logits.device, logits.dtype)
            logits = logits / t[:, None, None] if not bool((t == 1.0).all()) else logits
            lp = token_logprobs(logits[:, :-1], ids[:, 1:])
            valid = torch.arange(1, width, device=device)[None, :] < lengths[:, None]
            lp = torch.where(valid, lp, torch.zeros((), device=device))
            out = loss_fn(torch.nn.functional.pad(lp, (0, item.width - lp.shape[1])), ids_r)
            if not isinstance(out, (tuple, list)):
                return out, {"lm loss": out.detach().float().reshape(1)}
            loss, count = out
            tokens = torch.tensor(int(round(float(count))), dtype=torch.int)
            return loss, tokens, {"lm loss": torch.stack([loss.detach().float(), tokens.float()])}

        return output, loss_func

    return forward_step


def replayed_batch_routing(model, routing: Sequence[Tensor], width: int):
    """Inside, the ``TopKRouter`` modules of ``model`` (layer order) replay ``routing``
    (per rollout ``[len_r, moe_layers, topk]``) for a right-padded ``[R, width]`` batch:
    each router gets its layer's ``[width * R, topk]`` experts in Megatron's token order
    (sequence-major), padding routed to experts ``0..topk-1``. Megatron's own
    ``RouterReplay`` (``moe_enable_routing_replay=True``)."""
    found = [m for m in model.modules() if isinstance(m, TopKRouter)]
    stack = contextlib.ExitStack()
    for layer, router in enumerate(found):
        topk = router.topk
        target = torch.arange(topk).repeat(len(routing), width, 1)  # [R, width, k]
        for r, x in enumerate(routing):
            target[r, : x.shape[0]] = torch.as_tensor(x)[:, layer].long()
        device = next(model.parameters()).device
        stack.enter_context(replaying_topk(router, target.transpose(0, 1).reshape(-1, topk).to(device)))
    return stack


def naive_moe_logprobs(model, sequences: Sequence, *, fused_causal: bool = False,
                       routing: Optional[Sequence[Tensor]] = None) -> Tensor:
    """``[R, max_len - 1]`` log-probs of the naive MoE batch: every rollout one sequence of a
    right-padded batch with Megatron's MoE ``padding_mask`` (True = padding), so the router
    statistics count exactly the rollouts' tokens. Use a stock-spec model, or with
    ``fused_causal`` a branch-spec model: no mask tensor, the layer's causal mask type runs
    torch's fused ``is_causal`` SDPA (the benchmarks' fair naive). ``routing``: per rollout
    the experts ``[len_r, moe_layers, topk]`` every router replays
    (:func:`replayed_batch_routing`)."""
    seqs = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    device = next(model.parameters()).device
    lengths = torch.tensor([s.numel() for s in seqs], device=device)
    width = int(lengths.max())
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, : s.numel()] = s.to(device)
    pos = torch.arange(width, device=device)
    padding = pos[None, :] >= lengths[:, None]  # [b, s]
    mask = None if fused_causal else torch.ones(width, width, dtype=torch.bool, device=device).triu(1)[None, None]
    kwargs = {"padding_mask": padding} if bool(padding.any()) else {}
    replay = contextlib.nullcontext() if routing is None else replayed_batch_routing(model, routing, width)
    with replay:
        logits = model(ids, pos[None].expand(len(seqs), -1), attention_mask=mask, **kwargs)
    lp = token_logprobs(logits[:, :-1], ids[:, 1:])
    valid = pos[None, 1:] < lengths[:, None]
    return torch.where(valid, lp, torch.zeros((), device=device))
