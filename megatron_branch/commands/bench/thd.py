"""The packed-batch drop-in against the stock THD forward, side by side (``megatron-branch bench``).

What a stack already runs: a THD batch of whole sequences (``PackedSeqParams(qkv_format="thd")``)
through the model, log-probs of every token from all logits, one backward. What
:func:`megatron_branch.packed_logprobs` runs on the same batch: the sequences' prefix tree
built, each unique position once, logits for the scored rows. With nothing shared it must
cost at most about the stock forward (the goal is <= 1.05x); with a shared prompt it
gains the position ratio. Times are medians of interleaved repeats, and the ratio is paired
per repeat.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List

import torch

from megatron_branch._megatron import PackedSeqParams
from megatron_branch.commands.bench.stats import spread
from megatron_branch.reference.naive import token_logprobs
from megatron_branch.scoring.packed import packed_logprobs


def stock_thd_logprobs(model, tokens: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """``[T]`` log-probs of a THD batch through the model's THD path (no tree data): what a
    stack runs today; 0 at each sequence's last token."""
    seqlens = cu[1:] - cu[:-1]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.int(), cu_seqlens_kv=cu.int(),
                             max_seqlen_q=int(seqlens.max()), max_seqlen_kv=int(seqlens.max()))
    positions = torch.cat([torch.arange(int(n), device=tokens.device) for n in seqlens])
    logits = model(tokens[None], positions[None], attention_mask=None, packed_seq_params=params)  # [1, T, V]
    lp = token_logprobs(logits[:, :-1], tokens[None, 1:])[0]
    last = torch.zeros(tokens.numel(), dtype=torch.bool, device=tokens.device)
    last[(cu[1:] - 1).long()] = True
    return torch.where(last, torch.zeros((), device=lp.device), torch.cat([lp, lp.new_zeros(1)]))


def thd_batches(vocab: int, seqs: int, prompt: int, response: int, shared: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(0, vocab, (prompt,), generator=gen)
    out = []
    for i in range(seqs):
        p = head.clone() if shared else torch.randint(0, vocab, (prompt,), generator=gen)
        out.append(torch.cat([p, torch.randint(0, vocab, (response,), generator=gen)]))
    cu = torch.tensor([0] + [len(s) for s in out]).cumsum(0)
    return torch.cat(out), cu


def run_thd(model, vocab: int, shapes: List[Dict], repeats: int, echo=print) -> List[Dict]:
    """For each shape (``seqs``, ``prompt``, ``response``, ``shared``): seconds of the stock
    THD forward+backward and of ``packed_logprobs``, their paired ratio, and agreement."""
    rows = []
    for shape in shapes:
        tokens, cu = thd_batches(vocab, **shape)
        weights = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(1))

        def stock():
            (stock_thd_logprobs(model, tokens, cu) * weights).sum().backward()

        def ours():
            (packed_logprobs(model, tokens, cu) * weights).sum().backward()

        with torch.no_grad():
            diff = float((stock_thd_logprobs(model, tokens, cu) - packed_logprobs(model, tokens, cu)).abs().max())
        times: Dict[str, List[float]] = {"stock_thd": [], "packed_logprobs": []}
        for fn in (stock, ours):  # warm-up
            model.zero_grad(set_to_none=True)
            fn()
        for _ in range(repeats):
            for name, fn in (("stock_thd", stock), ("packed_logprobs", ours)):
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        ratios = [o / s for o, s in zip(times["packed_logprobs"], times["stock_thd"])]
        row = {**shape, "tokens": int(tokens.numel()), "seconds": {k: spread(v) for k, v in times.items()},
               "ratio_ours_over_stock": spread(ratios), "max_abs_logprob_diff": diff}
        rows.append(row)
        echo(f"THD {shape['seqs']} x ({shape['prompt']} + {shape['response']}) {'shared' if shape['shared'] else 'nothing shared'}: "
             f"packed_logprobs / stock THD = {statistics.median(ratios):.3f}x (|d lp| {diff:.1e})")
    return rows
