"""The gated delta rule step by step: a chunk-free reference kernel for Gated DeltaNet.

Megatron's torch kernel (``torch_chunk_gated_delta_rule``) computes in float32 chunks of
64 steps, so its result depends (at float32 rounding, ~1e-5 relative in the decay
parameters' gradients) on where the chunks start — a tree's segments start elsewhere
than a rollout's. This kernel runs the recurrence one step at a time in the inputs' dtype
(float64 in the exactness tests), with the same call signature, so a tree and the naive
computation can be compared free of that rounding: the test of the tree algorithm itself.

Per step ``t`` (``q`` scaled by ``1/sqrt(d_k)``, as the chunk kernel does)::

    S = S * exp(g_t)
    S = S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False, cu_seqlens=None,
                               **_) -> Tuple[Tensor, Optional[Tensor]]:
    """``q, k [B, T, H, dk]``, ``v [B, T, H, dv]``, ``g, beta [B, T, H]`` ->
    ``(out [B, T, H, dv], final state [B, H, dk, dv] or None)``, in ``v``'s dtype."""
    if use_qk_l2norm_in_kernel or cu_seqlens is not None:
        raise ValueError("recurrent_gated_delta_rule: no in-kernel L2 norm or cu_seqlens "
                         "(not used by GDN's torch path)")
    dtype = v.dtype
    b, t, h, dk = k.shape
    q = q.to(dtype) * dk ** -0.5
    k, g, beta = k.to(dtype), g.to(dtype), beta.to(dtype)
    state = (initial_state.to(dtype) if initial_state is not None
             else v.new_zeros((b, h, dk, v.shape[-1])))
    out = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        kv = torch.einsum("bhkv,bhk->bhv", state, k[:, i])
        delta = (v[:, i] - kv) * beta[:, i][..., None]
        state = state + k[:, i][..., None] * delta[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, i]))
    return torch.stack(out, 1), (state if output_final_state else None)
