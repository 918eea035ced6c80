"""Attention-piece kernels that return the log-sum-exp, and their backwards.

A *piece* is a dense attention of a query range on a key range, either unmasked or
causal, aligned top-left (query ``i`` sees keys ``0..i``: a square, or a segment with its
descendants below it, :func:`top_left_causal`). Every kernel here takes
Megatron's per-token layout ``[n, heads, head_dim]`` views (no copies), or a batch of
equally shaped pieces ``[B, n, heads, head_dim]``, and returns ``out [(B,) nq, heads,
head_dim]`` and ``lse [(B,) heads, nq]`` (float32). The backward takes the
*merged* output and log-sum-exp of all pieces of a query, as ring/cascade attention
requires: ``P = exp(S - lse_merged)``, ``D = rowsum(dO * O_merged)``.

* ``flash_cpu``: torch's fused CPU flash-attention kernel
  (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward) — the same
  kernel family torch's SDPA uses on CPU, memory O(n * head_dim). Calls on pieces of
  fewer than :data:`FLASH_CPU_SERIAL_KEYS` keys run on one intra-op thread
  (:func:`serial_if_few_keys`).
* ``math``: plain matmuls in float32 on any device; memory O(nq * nk * heads), so the
  caller tiles keys as well as queries: the reference.
* ``flash_cuda``: torch's CUDA FlashAttention-2 with its log-sum-exp (bf16/fp16), a batch
  of equal pieces as equal varlen sequences; opt in with
  ``get_branch_layer_spec(kernel="flash_cuda")``.

The CUDA default is neither: the varlen kernels of :mod:`megatron_branch.attention.varlen`
run a whole tree in ``1 + depth`` calls (:func:`default_kernel`).

Value heads may be narrower or wider than query/key heads (multi-latent attention:
``qk_head_dim + qk_pos_emb_head_dim`` against ``v_head_dim``). The flash kernels need one
head size, so :func:`equal_head_dims` pads the narrower side with zero columns and cuts
the result back: zero key columns add nothing to ``q . k``, zero value columns give zero
output columns whose gradient is zero, so every kept number is the unpadded one.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional, Tuple

import torch
from torch import Tensor


def _bhsd(x: Tensor) -> Tensor:
    # [n, h, d] -> [1, h, n, d]; [B, n, h, d] -> [B, h, n, d] (views)
    return x.transpose(-3, -2) if x.dim() == 4 else x.transpose(0, 1).unsqueeze(0)


def _blse(lse: Tensor) -> Tensor:
    # [h, n] -> [1, h, n]; [B, h, n] as is
    return lse if lse.dim() == 3 else lse.unsqueeze(0)


def _back(x: Tensor, batched: bool) -> Tensor:
    # [B, h, n, d] -> [B, n, h, d], or [n, h, d] unbatched
    return x.transpose(1, 2) if batched else x[0].transpose(0, 1)


# torch's CPU flash kernel runs a call as (piece, head, query block) tasks over the intra-op
# threads. On pieces of few keys a task takes microseconds, and a second thread made such
# calls slower, not faster, on the 2-core machines the bench runs on (250 causal pieces of
# 16 x 16: 1.5-2x slower forward and backward on two threads than on one); from 64 keys on
# the result is mixed, and wide pieces gain from every thread. `python
# tools/flash_cpu_threads.py` prints the measurement on the machine at hand.
FLASH_CPU_SERIAL_KEYS = 64


@contextlib.contextmanager
def intra_op_threads(threads: int):
    """torch's intra-op thread count set to ``threads`` inside, restored after."""
    restore = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(restore)


def serial_if_few_keys(num_keys: int):
    """A context running torch's CPU flash kernel on one intra-op thread when a piece has
    fewer than :data:`FLASH_CPU_SERIAL_KEYS` keys (a no-op otherwise, or on one thread).

    Every task of the kernel computes its own output rows, forward and backward, so the
    values do not depend on the thread count (bitwise: ``tests/test_attention.py``); only
    the time does. The thread count is torch's process-wide setting: for the duration of
    the call, other threads' torch ops also run on one thread.
    """
    if num_keys >= FLASH_CPU_SERIAL_KEYS or torch.get_num_threads() == 1:
        return contextlib.nullcontext()
    return intra_op_threads(1)


def flash_cpu_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    with serial_if_few_keys(k.shape[-3]):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
        )
    batched = q.dim() == 4
    # out [B, h, nq, d] -> [(B,) nq, h, d]; lse [B, h, nq] -> [(B,) h, nq]
    return _back(out, batched), (lse if batched else lse[0])


def flash_cpu_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    with serial_if_few_keys(k.shape[-3]):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), _blse(lse).contiguous(),
            0.0, causal, scale=scale,
        )
    batched = q.dim() == 4
    return _back(dq, batched), _back(dk, batched), _back(dv, batched)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    # [(B,) nq, h, d] x [(B,) nk, h, d] -> [(B,) h, nq, nk]
    s = torch.einsum("...qhd,...khd->...hqk", q.float(), k.float()) * scale
    if causal:  # aligned top-left, as torch's SDPA: query i sees keys 0..i
        nq, nk = q.shape[-3], k.shape[-3]
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # [(B,) h, nq]
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("...hqk,...khd->...qhd", p, v.float())
    return out.to(q.dtype), lse


def math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.unsqueeze(-1))  # [(B,) h, nq, nk]
    do = dout.float()
    dv = torch.einsum("...hqk,...qhd->...khd", p, do)
    dp = torch.einsum("...qhd,...khd->...hqk", do, v.float())
    delta = (do * out.float()).sum(-1).transpose(-1, -2)  # [(B,) h, nq]
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.einsum("...hqk,...khd->...qhd", ds, k.float())
    dk = torch.einsum("...hqk,...qhd->...khd", ds, q.float())
    return dq, dk, dv


def _uniform_cu(count: int, length: int, device) -> Tensor:
    # cu_seqlens of `count` sequences of `length` rows, made on the device (no host copy)
    return torch.arange(0, (count + 1) * length, max(length, 1), dtype=torch.int32, device=device)[: count + 1]


def flash_cuda_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """torch's CUDA FlashAttention-2 (bf16/fp16) on a piece or a batch of equal pieces, as
    varlen sequences of equal length (``aten::_flash_attention_forward`` with ``cu_seqlens``:
    GQA by the kernel, the log-sum-exp returned). Causal pieces are squares here (FA2
    aligns causal masks bottom-right, :func:`top_left_causal`)."""
    batched = q.dim() == 4
    qb, kb, vb = (x if batched else x.unsqueeze(0) for x in (q, k, v))  # [B, n, h, d]
    b, nq, h, _ = qb.shape
    nk = kb.shape[1]
    out, lse = torch.ops.aten._flash_attention_forward(
        qb.reshape(b * nq, h, -1), kb.reshape(b * nk, kb.shape[2], -1), vb.reshape(b * nk, vb.shape[2], -1),
        _uniform_cu(b, nq, q.device), _uniform_cu(b, nk, q.device), nq, nk, 0.0, causal, False, scale=scale,
    )[:2]
    # out [B * nq, h, d] -> [(B,) nq, h, d]; lse [h, B * nq] -> [(B,) h, nq]
    out = out.view(b, nq, h, -1)
    lse = lse.view(h, b, nq).transpose(0, 1)
    return (out, lse) if batched else (out[0], lse[0])


def flash_cuda_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`flash_cuda_forward` given any (merged) ``out``/``lse``."""
    batched = q.dim() == 4
    qb, kb, vb, ob, dob = (x if batched else x.unsqueeze(0) for x in (q, k, v, out, dout))
    lb = lse if batched else lse.unsqueeze(0)  # [B, h, nq]
    b, nq, h, _ = qb.shape
    nk, hk = kb.shape[1], kb.shape[2]
    flat = lambda x, n, heads: x.reshape(b * n, heads, -1).contiguous()  # noqa: E731
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        flat(dob, nq, h), flat(qb, nq, h), flat(kb, nk, hk), flat(vb, nk, hk), flat(ob, nq, h),
        lb.transpose(0, 1).reshape(h, b * nq).contiguous(), _uniform_cu(b, nq, q.device),
        _uniform_cu(b, nk, q.device), nq, nk, 0.0, causal,
        torch.zeros((2,), dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device), scale=scale,
    )
    shape = (lambda x, n, heads: x.view(b, n, heads, -1)) if batched else (lambda x, n, heads: x.view(n, heads, -1))
    return shape(dq, nq, h), shape(dk, nk, hk), shape(dv, nk, hk)


def _pad_to(x: Tensor, width: int) -> Tensor:
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def equal_head_dims(forward, backward):
    """A (forward, backward) kernel pair that also takes value heads of another width."""

    def padded_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
        dqk, dv = q.shape[-1], v.shape[-1]
        if dqk == dv:
            return forward(q, k, v, causal, scale)
        width = max(dqk, dv)
        out, lse = forward(_pad_to(q, width), _pad_to(k, width), _pad_to(v, width), causal, scale)
        return out[..., :dv], lse

    def padded_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        causal: bool, scale: float):
        dqk, dv = q.shape[-1], v.shape[-1]
        if dqk == dv:
            return backward(dout, q, k, v, out, lse, causal, scale)
        width = max(dqk, dv)
        dq, dk, dvv = backward(_pad_to(dout, width), _pad_to(q, width), _pad_to(k, width), _pad_to(v, width),
                               _pad_to(out, width), lse, causal, scale)
        return dq[..., :dqk], dk[..., :dqk], dvv[..., :dv]

    return padded_forward, padded_backward


@functools.lru_cache(maxsize=None)
def cpu_flash_takes_gqa() -> bool:
    """Whether torch's CPU flash kernel (forward and backward) takes fewer K/V heads than
    query heads and groups them itself, exactly as if K/V were repeated (torch 2.13 does;
    probed once on a tiny input, so another torch falls back to repeating)."""
    cpu = torch.device("cpu")  # the probe is of the CPU kernel, whatever device the model is on
    gen = torch.Generator(device=cpu).manual_seed(0)
    q, k, v = (torch.randn(1, h, 4, 8, generator=gen, device=cpu) for h in (2, 1, 1))
    try:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=0.5)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            torch.ones_like(out), q, k, v, out, lse, 0.0, True, scale=0.5)
    except RuntimeError:
        return False
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    ref_out, ref_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kr, vr, 0.0, True, scale=0.5)
    ref = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        torch.ones_like(out), q, kr, vr, ref_out, ref_lse, 0.0, True, scale=0.5)
    same = torch.allclose(out, ref_out) and grads[1].shape == k.shape
    return bool(same and torch.allclose(grads[1], ref[1].view(1, 1, 2, 4, 8).sum(2), atol=1e-6))


@functools.lru_cache(maxsize=None)
def cpu_flash_causal_top_left() -> bool:
    """Whether torch's CPU flash kernel aligns a causal mask of more queries than keys
    top-left (query ``i`` sees keys ``0..i``, as torch's SDPA documents), forward and
    backward; probed once against the explicit mask on a tiny input."""
    # the first call may come from inside no_grad / inference mode (scoring)
    with torch.inference_mode(False), torch.enable_grad():
        cpu = torch.device("cpu")
        gen = torch.Generator(device=cpu).manual_seed(0)
        q, k, v = (torch.randn(1, 1, n, 8, generator=gen, device=cpu, requires_grad=True) for n in (6, 3, 3))
        mask = torch.ones(6, 3, dtype=torch.bool, device=cpu).tril()
        try:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.detach(), k.detach(), v.detach(), 0.0, True, scale=0.5)
            dout = torch.ones_like(out)
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q.detach(), k.detach(), v.detach(), out, lse, 0.0, True, scale=0.5)
        except RuntimeError:
            return False
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)
        ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    return bool(torch.allclose(out, ref, atol=1e-6)
                and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, ref_grads)))


def top_left_causal(kernel: str) -> bool:
    """The kernel's causal mask is aligned top-left on pieces with more queries than keys,
    so a segment and its descendants can be one piece (``plan_pieces(..., fuse=True)``).
    ``flash_cuda`` is not fused: FlashAttention-2, which torch's CUDA kernel is, aligns
    such a mask bottom-right."""
    return kernel == "math" or (kernel == "flash_cpu" and cpu_flash_causal_top_left())


def takes_gqa(kernel: str) -> bool:
    """The kernel groups query heads over fewer K/V heads itself (no repeated K/V):
    FlashAttention-2 does; torch's CPU flash kernel where the probe says so."""
    return kernel == "flash_cuda" or (kernel == "flash_cpu" and cpu_flash_takes_gqa())


KERNELS = {
    "flash_cpu": equal_head_dims(flash_cpu_forward, flash_cpu_backward),
    "flash_cuda": equal_head_dims(flash_cuda_forward, flash_cuda_backward),
    "math": (math_forward, math_backward),
}


def default_kernel(device: torch.device, dtype: Optional[torch.dtype] = None) -> str:
    """The kernel used when none is named: torch's fused flash kernel on CPU; on CUDA the
    varlen kernels (:mod:`megatron_branch.attention.varlen`), FlashAttention-2 for bf16/fp16
    and the memory-efficient kernel for float32 (FlashAttention has none)."""
    if device.type == "cpu":
        return "flash_cpu"
    return "flash_varlen" if dtype in (torch.float16, torch.bfloat16) else "efficient_varlen"
