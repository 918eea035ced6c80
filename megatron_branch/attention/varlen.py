"""Variable-length attention kernels with the log-sum-exp: one contract, a CUDA and a CPU side.

A *call* attends the packed queries ``q [Tq, heads, d]`` to the packed keys ``k, v
[Tk, kv_heads, d]`` sequence by sequence: sequence ``i`` is the query rows
``cu_q[i]:cu_q[i+1]`` on the key rows ``cu_k[i]:cu_k[i+1]`` (both int32 on the device,
as FlashAttention's ``cu_seqlens``). The conventions, the same on every device:

* **causal alignment is bottom-right**: with ``lq`` queries on ``lk`` keys, query ``i``
  sees keys ``0 .. lk - lq + i`` (FlashAttention-2's rule; the same as top-left on a
  square);
* **GQA by the kernel**: ``heads % kv_heads == 0``; K/V are never repeated by the caller,
  and ``dk``/``dv`` come back with ``kv_heads``;
* **the log-sum-exp is ``[heads, Tq]`` float32**, and a query row with no key gets
  ``lse = +inf`` and a zero output (FlashAttention-2's convention; :func:`lse_for_merge`
  maps it to ``-inf`` before a log-sum-exp merge);
* **the backward takes any ``(out, lse)``**, in particular the *merged* ones of all the
  calls a query takes part in (``P = exp(S - lse)``, ``D = rowsum(dO * O)``), as cascade
  and ring attention require; rows of sequences without keys get ``dq = 0``, keys of
  sequences without queries ``dk = dv = 0``.

Kernels (:data:`VARLEN_KERNELS`):

* ``flash_varlen``: on CUDA, torch's FlashAttention-2 (``aten::_flash_attention_forward``
  / ``_backward`` with ``cu_seqlens``: what ``torch.nn.attention.varlen.varlen_attn`` calls),
  bf16/fp16, head size at most 256; on CPU, the same contract over torch's fused CPU flash
  kernel, sequence by sequence (:func:`_cpu_forward`), so the CPU suite runs everything of
  the CUDA path but the kernel itself.
* ``efficient_varlen``: on CUDA, torch's memory-efficient kernel
  (``aten::_efficient_attention_forward`` / ``_backward``, ``custom_mask_type=2`` for
  bottom-right causal), for float32, sequence by sequence (its varlen mode would size the
  backward's workspace by sequences x the longest sequence); K/V heads repeated for GQA (it
  has none). On CPU, the CPU side of ``flash_varlen``.

Our own code: Megatron-Core has no tree attention; torch's public ``varlen_attn`` has no
backward that takes a merged output and log-sum-exp, so the aten ops are called here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_branch.attention.kernels import KERNELS, takes_gqa

# FlashAttention-2's largest head size (torch's build); the memory-efficient kernel has no such limit.
FLASH_MAX_HEAD_DIM = 256
# Head sizes are padded with zero columns to a multiple of this (the kernels' alignment).
HEAD_DIM_MULTIPLE = 8
# The memory-efficient kernel's log-sum-exp rows per sequence are a multiple of this.
EFFICIENT_LSE_ALIGN = 32

Span = Tuple[int, int, int, int]  # (q_lo, q_hi, k_lo, k_hi)


@dataclass
class VarlenCall:
    """One varlen kernel call: ``spans[i]`` is sequence ``i``'s query and key rows.

    Built on the host by :func:`~megatron_branch.attention.varlen_cascade.plan_calls` and
    moved to the device once per unit (:meth:`to`), so a layer's call needs no host work.

    Attributes:
        spans: ``(q_lo, q_hi, k_lo, k_hi)`` per sequence, consecutive and covering
            ``[0, num_q)`` and ``[0, num_k)`` (sequences with no queries or no keys fill gaps).
        causal: bottom-right causal masking in every sequence.
        num_q, num_k: the rows of ``q`` and of ``k``/``v`` the call is planned for.
        cu_q, cu_k: ``[len(spans) + 1]`` int32 on the device.
        max_q, max_k: the longest query and key sequence (host ints: no sync in a layer).
        has_keys: ``[num_q]`` bool on the device, the row's sequence has keys.
        has_queries: ``[num_k]`` bool on the device, the key's sequence has queries.
    """

    spans: List[Span]
    causal: bool
    num_q: int
    num_k: int
    cu_q: Optional[Tensor] = None
    cu_k: Optional[Tensor] = None
    max_q: int = 0
    max_k: int = 0
    has_keys: Optional[Tensor] = None
    has_queries: Optional[Tensor] = None

    @classmethod
    def from_spans(cls, spans: Sequence[Span], causal: bool, num_q: int, num_k: int,
                   device=None) -> "VarlenCall":
        """The call of ``spans`` with its index tensors on ``device`` (one copy each)."""
        spans = list(spans)
        _check_spans(spans, num_q, num_k)
        if causal:  # the rows before a causal sequence's first key see none: a keyless sequence of their own
            spans = [part for span in spans for part in _split_keyless_rows(span)]
        cu_q = [0] + [s[1] for s in spans]
        cu_k = [0] + [s[3] for s in spans]
        lq = [s[1] - s[0] for s in spans]
        lk = [s[3] - s[2] for s in spans]
        row_seq = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor(lq, dtype=torch.long))
        has_keys = torch.tensor([k > 0 for k in lk], dtype=torch.bool)[row_seq]
        key_seq = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor(lk, dtype=torch.long))
        has_queries = torch.tensor([q > 0 for q in lq], dtype=torch.bool)[key_seq]
        # one host -> device copy per tensor, once per unit (pinned and non-blocking on CUDA)
        to = functools.partial(_to_device, device=device)
        return cls(spans, causal, num_q, num_k, to(torch.tensor(cu_q, dtype=torch.int32)),
                   to(torch.tensor(cu_k, dtype=torch.int32)), max(lq, default=0), max(lk, default=0),
                   to(has_keys), to(has_queries))


def _split_keyless_rows(span: Span) -> List[Span]:
    """A bottom-right causal sequence of more queries than keys as a keyless sequence of its
    first ``lq - lk`` rows and a square: what the kernels compute on their own for the
    first, the memory-efficient kernel does not (it masks such rows wrongly)."""
    q_lo, q_hi, k_lo, k_hi = span
    extra = (q_hi - q_lo) - (k_hi - k_lo)
    if extra <= 0 or k_hi == k_lo:
        return [span]
    return [(q_lo, q_lo + extra, k_lo, k_lo), (q_lo + extra, q_hi, k_lo, k_hi)]


def _to_device(x: Tensor, device) -> Tensor:
    if device is None or torch.device(device).type == "cpu":
        return x
    return x.pin_memory().to(device, non_blocking=True)


def _check_spans(spans: List[Span], num_q: int, num_k: int) -> None:
    q_at = k_at = 0
    for q_lo, q_hi, k_lo, k_hi in spans:
        if q_lo != q_at or k_lo != k_at or q_hi < q_lo or k_hi < k_lo:
            raise ValueError(f"spans: sequences must be consecutive, got {spans}")
        q_at, k_at = q_hi, k_hi
    if q_at != num_q or k_at != num_k:
        raise ValueError(f"spans: cover {q_at} query and {k_at} key rows, not {num_q} and {num_k}")


def lse_for_merge(lse: Tensor) -> Tensor:
    """The contract's ``+inf`` (a row without keys) as ``-inf``, the neutral element of a
    log-sum-exp merge (in place; returns ``lse``)."""
    return lse.masked_fill_(torch.isposinf(lse), float("-inf"))


def check_inputs(kernel: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise ``ValueError`` naming the kernel, dtype or head size the kernel cannot run on
    these tensors (:func:`check_kernel`)."""
    check_kernel(kernel, q.device.type, q.dtype, max(q.shape[-1], v.shape[-1]), q.shape[1], k.shape[1])


def check_kernel(kernel: str, device_type: str, dtype: torch.dtype, head_dim: int, heads: int,
                 kv_heads: int) -> None:
    """Raise ``ValueError`` naming what ``kernel`` cannot run: an unknown name, a dtype
    FlashAttention lacks (float32: use ``efficient_varlen``), a head size past its limit,
    query heads that are no multiple of the key/value heads. The CPU side runs every dtype
    and size the CPU flash kernel does."""
    if kernel not in VARLEN_KERNELS:
        raise ValueError(f"kernel: {kernel!r} is not one of {tuple(VARLEN_KERNELS)}")
    if heads % kv_heads:
        raise ValueError(f"heads: {heads} query heads are not a multiple of {kv_heads} key/value heads")
    if device_type != "cuda" or kernel != "flash_varlen":
        return
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype: kernel 'flash_varlen' runs bf16/fp16 on CUDA, got {dtype}; "
                         "use kernel='efficient_varlen' (or the default) for float32")
    if head_dim > FLASH_MAX_HEAD_DIM:
        raise ValueError(f"head_dim: kernel 'flash_varlen' takes at most {FLASH_MAX_HEAD_DIM}, got {head_dim}; "
                         "use kernel='efficient_varlen'")


# ------------------------------------------------------------------------------------ CPU side
def _cpu_square_or_rect(q, k, v, causal, scale):
    """``(out [lq, h, dv], lse [h, lq])`` of one bottom-right-aligned sequence on the CPU
    flash kernel (top-left aligned, so a causal sequence is cut into an unmasked
    rectangle and a causal square; queries before the first key see nothing)."""
    lq, lk = q.shape[0], k.shape[0]
    out = q.new_zeros((lq, q.shape[1], v.shape[-1]))
    lse = torch.full((q.shape[1], lq), float("inf"), dtype=torch.float32, device=q.device)
    flash_cpu_forward = KERNELS["flash_cpu"][0]  # head sizes padded to one (multi-latent attention)
    if not causal:
        o, piece_lse = flash_cpu_forward(q, k, v, False, scale)
        return o, piece_lse.float()
    first = max(lq - lk, 0)  # rows before it see no key
    off = lk - (lq - first)  # keys every remaining row sees (the rectangle)
    o, piece_lse = flash_cpu_forward(q[first:], k[off:], v[off:], True, scale)
    out[first:], lse[:, first:] = o, piece_lse.float()
    if off:
        o2, l2 = flash_cpu_forward(q[first:], k[:off], v[:off], False, scale)
        merged = torch.logaddexp(lse[:, first:], l2.float())
        w1 = torch.exp(lse[:, first:] - merged).transpose(0, 1).unsqueeze(-1)
        w2 = torch.exp(l2.float() - merged).transpose(0, 1).unsqueeze(-1)
        out[first:] = (o.float() * w1 + o2.float() * w2).to(out.dtype)
        lse[:, first:] = merged
    return out, lse


def _gqa_cpu(k: Tensor, v: Tensor, heads: int) -> Tuple[Tensor, Tensor, int]:
    rep = 1 if takes_gqa("flash_cpu") else heads // k.shape[1]
    if rep == 1:
        return k, v, 1
    return k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), rep


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, call: VarlenCall, scale: float) -> Tuple[Tensor, Tensor]:
    k, v, _ = _gqa_cpu(k, v, q.shape[1])
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    for q_lo, q_hi, k_lo, k_hi in call.spans:
        if q_hi > q_lo and k_hi > k_lo:
            o, seq_lse = _cpu_square_or_rect(q[q_lo:q_hi], k[k_lo:k_hi], v[k_lo:k_hi], call.causal, scale)
            out[q_lo:q_hi], lse[:, q_lo:q_hi] = o, seq_lse
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, call: VarlenCall, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    hk = k.shape[1]
    flash_cpu_backward = KERNELS["flash_cpu"][1]
    k, v, rep = _gqa_cpu(k, v, q.shape[1])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for q_lo, q_hi, k_lo, k_hi in call.spans:
        lq, lk = q_hi - q_lo, k_hi - k_lo
        if not (lq and lk):
            continue
        first = max(lq - lk, 0) if call.causal else 0
        off = lk - (lq - first) if call.causal else 0
        rows = slice(q_lo + first, q_hi)
        parts = [(k_lo + off, k_hi, call.causal)] + ([(k_lo, k_lo + off, False)] if off else [])
        for ka, kb, causal in parts:
            # the CPU kernel's lse is float32, or float64 for float64 inputs
            lse_rows = lse[:, rows].to(torch.float64 if q.dtype == torch.float64 else torch.float32).contiguous()
            gq, gk, gv = flash_cpu_backward(dout[rows], q[rows], k[ka:kb], v[ka:kb], out[rows], lse_rows, causal,
                                            scale)
            dq[rows] += gq
            dk[ka:kb] += gk
            dv[ka:kb] += gv
    if rep > 1:  # [Tk, h, d] -> [Tk, hk, rep, d] -> summed over the repeated heads
        dk, dv = (x.view(x.shape[0], hk, rep, x.shape[-1]).sum(2) for x in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------------- CUDA side
def _pad_heads(x: Tensor, width: int) -> Tensor:
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _padded_width(q: Tensor, v: Tensor) -> int:
    # zero columns are exact: they add nothing to q . k, and give zero output columns whose
    # gradient is zero (multi-latent attention's unequal head sizes; kernel alignment)
    width = max(q.shape[-1], v.shape[-1])
    return -(-width // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


def _flash_cuda_forward(q, k, v, call: VarlenCall, scale):
    width, dv = _padded_width(q, v), v.shape[-1]
    # max_q is an upper bound: at 1, FlashAttention-2's single-query path would regroup the
    # heads by the sequence count, which the sequences without queries break
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        _pad_heads(q, width), _pad_heads(k, width), _pad_heads(v, width), call.cu_q, call.cu_k,
        max(call.max_q, 2), call.max_k, 0.0, call.causal, False, scale=scale)
    if lse.shape != (q.shape[1], q.shape[0]):  # shapes only, no sync: the layout this module is written for
        raise RuntimeError(f"flash_varlen: the kernel returned lse {tuple(lse.shape)}, not [heads, total_q] = "
                           f"{(q.shape[1], q.shape[0])}; this torch's FlashAttention differs from 2.13's")
    return out[..., :dv], lse


def _flash_cuda_backward(dout, q, k, v, out, lse, call: VarlenCall, scale):
    width, dqk, dv = _padded_width(q, v), q.shape[-1], v.shape[-1]
    pad = functools.partial(_pad_heads, width=width)
    dq, dk, dvv = torch.ops.aten._flash_attention_backward(
        pad(dout).contiguous(), pad(q), pad(k), pad(v), pad(out).contiguous(), lse.contiguous(),
        call.cu_q, call.cu_k, max(call.max_q, 2), call.max_k, 0.0, call.causal, _rng_state(q.device),
        _unused(q.device), scale=scale)
    return dq[..., :dqk], dk[..., :dqk], dvv[..., :dv]


@functools.lru_cache(maxsize=None)
def _rng_state(device) -> Tensor:
    # dropout is 0: the kernels read no random state (torch's varlen_attn passes zeros too)
    return torch.zeros((2,), dtype=torch.uint64, device=device)


@functools.lru_cache(maxsize=None)
def _unused(device) -> Tensor:
    return torch.empty(0, device=device)


def _efficient_one(q, k, v, causal, scale):
    """One sequence on the memory-efficient kernel: ``(out [lq, h, dv], lse [h, lq])``."""
    rep = q.shape[1] // k.shape[1]  # the memory-efficient kernel has no GQA: repeat K/V heads
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    width = _padded_width(q, v)
    # [n, h, d] -> [1, n, h, d]; custom_mask_type 2: causal, bottom-right
    q4, k4, v4 = (_pad_heads(x, width).unsqueeze(0) for x in (q, k, v))
    out, lse = torch.ops.aten._efficient_attention_forward(
        q4, k4, v4, None, None, None, None, None, 0.0, 2 if causal else 0, True, scale=scale)[:2]
    # out [1, lq, h, width]; lse [1, h, lq rounded up to 32]
    return out[0, ..., : v.shape[-1]], lse[0, :, : q.shape[0]]


def _efficient_cuda_forward(q, k, v, call: VarlenCall, scale):
    # Sequence by sequence: the kernel's varlen mode sizes its backward workspace by
    # sequences x max_q, which a tree's gap sequences make as long as the prompt. float32 is
    # the reference precision on a GPU, not the fast path (flash_varlen, bf16).
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    for q_lo, q_hi, k_lo, k_hi in call.spans:
        if q_hi > q_lo and k_hi > k_lo:
            out[q_lo:q_hi], lse[:, q_lo:q_hi] = _efficient_one(q[q_lo:q_hi], k[k_lo:k_hi], v[k_lo:k_hi],
                                                               call.causal, scale)
    return out, lse


def _efficient_cuda_backward(dout, q, k, v, out, lse, call: VarlenCall, scale):
    hk, h, dqk, dv = k.shape[1], q.shape[1], q.shape[-1], v.shape[-1]
    rep = h // hk
    width = _padded_width(q, v)
    gq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    gk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    gv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for q_lo, q_hi, k_lo, k_hi in call.spans:
        if not (q_hi > q_lo and k_hi > k_lo):
            continue
        ks, vs = k[k_lo:k_hi], v[k_lo:k_hi]
        if rep > 1:
            ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        pad = lambda x: _pad_heads(x, width).unsqueeze(0).contiguous()  # noqa: E731 - [n, h, d] -> [1, n, h, w]
        lq = q_hi - q_lo
        lse_rows = lse.new_full((1, h, -(-lq // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN), float("inf"))
        lse_rows[0, :, :lq] = lse[:, q_lo:q_hi]
        dq, dk, dvv = torch.ops.aten._efficient_attention_backward(
            pad(dout[q_lo:q_hi]), pad(q[q_lo:q_hi]), pad(ks), pad(vs), None, pad(out[q_lo:q_hi]), None, None, lq,
            k_hi - k_lo, lse_rows, 0.0, _philox(q.device), _philox(q.device), 2 if call.causal else 0, False,
            scale=scale)[:3]
        dk, dvv = dk[0, ..., :dqk], dvv[0, ..., :dv]
        if rep > 1:  # [n, h, d] -> [n, hk, rep, d] -> summed over the repeated heads
            dk, dvv = (x.reshape(x.shape[0], hk, rep, x.shape[-1]).sum(2) for x in (dk, dvv))
        gq[q_lo:q_hi] += dq[0, ..., :dqk]
        gk[k_lo:k_hi] += dk
        gv[k_lo:k_hi] += dvv
    return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


@functools.lru_cache(maxsize=None)
def _philox(device) -> Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)  # dropout 0: never read


# ------------------------------------------------------------------------------- the contract
def _normalised_forward(cuda_forward: Callable) -> Callable:
    def forward(q: Tensor, k: Tensor, v: Tensor, call: VarlenCall, scale: float) -> Tuple[Tensor, Tensor]:
        if q.device.type != "cuda":
            return _cpu_forward(q, k, v, call, scale)
        out, lse = cuda_forward(q, k, v, call, scale)
        # the conventions held here, whatever a kernel does on rows without keys (in place:
        # one pass over the fresh outputs, no copy; tools/gpu_check.py checks the kernels too)
        out.masked_fill_(~call.has_keys[:, None, None], 0.0)
        return out, lse.float().masked_fill_(~call.has_keys[None, :], float("inf"))
    return forward


def _normalised_backward(cuda_backward: Callable) -> Callable:
    def backward(dout, q, k, v, out, lse, call: VarlenCall, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
        if q.device.type != "cuda":
            return _cpu_backward(dout, q, k, v, out, lse, call, scale)
        dq, dk, dv = cuda_backward(dout, q, k, v, out, lse, call, scale)
        dq.masked_fill_(~call.has_keys[:, None, None], 0.0)
        keep = call.has_queries[:, None, None]
        return dq, dk.masked_fill_(~keep, 0.0), dv.masked_fill_(~keep, 0.0)
    return backward


VARLEN_KERNELS: Dict[str, Tuple[Callable, Callable]] = {
    "flash_varlen": (_normalised_forward(_flash_cuda_forward), _normalised_backward(_flash_cuda_backward)),
    "efficient_varlen": (_normalised_forward(_efficient_cuda_forward),
                         _normalised_backward(_efficient_cuda_backward)),
}


def varlen_forward(kernel: str, q: Tensor, k: Tensor, v: Tensor, call: VarlenCall,
                   scale: float) -> Tuple[Tensor, Tensor]:
    """One call's ``(out [Tq, heads, dv] in q's dtype, lse [heads, Tq] float32)``."""
    return VARLEN_KERNELS[kernel][0](q, k, v, call, scale)


def varlen_backward(kernel: str, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    call: VarlenCall, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dq [Tq, heads, d], dk [Tk, kv_heads, d], dv)`` of one call given any ``(out, lse)``
    (the merged ones of a cascade)."""
    return VARLEN_KERNELS[kernel][1](dout, q, k, v, out, lse, call, scale)


@functools.lru_cache(maxsize=256)
def single_call(num_q: int, num_k: int, causal: bool, device) -> VarlenCall:
    """The call of one sequence (``num_q`` queries on ``num_k`` keys), built once per shape
    and device: a cached prefix's piece, whose shape repeats over layers and units."""
    return VarlenCall.from_spans([(0, num_q, 0, num_k)], causal, num_q, num_k, device)


def piece_kernel(kernel: str) -> Tuple[Callable, Callable]:
    """``kernel`` as a piece kernel (``(q [n, h, d], k, v, causal, scale) -> (out, lse [h, n])``
    and its backward, :mod:`megatron_branch.attention.kernels`' signature) for the code that
    runs single pieces (the cached prefix, :mod:`megatron_branch.attention.prefix`)."""
    fwd_v, bwd_v = VARLEN_KERNELS[kernel]

    def forward(q, k, v, causal, scale):
        if q.dim() != 3:
            raise ValueError(f"q: a varlen piece kernel takes [n, heads, d], got {tuple(q.shape)}")
        out, lse = fwd_v(q, k, v, single_call(q.shape[0], k.shape[0], causal, q.device), scale)
        return out, lse_for_merge(lse)

    def backward(dout, q, k, v, out, lse, causal, scale):
        return bwd_v(dout, q, k, v, out, lse, single_call(q.shape[0], k.shape[0], causal, q.device), scale)

    return forward, backward
