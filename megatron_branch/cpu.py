"""Explicit shims that let megatron-core run on a machine without CUDA.

megatron-core 0.16 assumes a GPU in a handful of places. :func:`enable_cpu` patches
exactly those, records what it patched and why, and is idempotent. It is never applied
at import time: call it yourself (tests, examples and the CLI do) before building a model.
Where CUDA is available it does nothing.

Patched points (megatron-core 0.16.1, torch 2.13 CPU build):

* ``torch.cuda.current_device`` — megatron allocates new tensors on it in ~40 places
  (rotary tables, TP/SP buffers, global memory buffer); on a CPU-only build the call
  raises. Routed to the CPU device.
* ``torch.cuda.synchronize`` — called by dist-checkpointing; a no-op on CPU.
* ``torch.cuda.current_stream`` — megatron-core 0.19's DDP bucket reduction waits on the
  current stream's CUDA-graph events before every reduction; on CPU there is one
  implicit stream, so it answers a stream whose waits do nothing.
* the model-parallel RNG tracker — ``CudaRNGStatesTracker`` forks CUDA generators
  (attention dropout, TP weight init). Replaced by :class:`CpuRNGStatesTracker`, which
  forks the CPU generator the same way.
* ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` — activation
  recompute saves and restores the CUDA generator; on CPU there is none (the CPU
  generator is saved by the same code already), so they hold nothing.
* ``fused_softmax.get_default_causal_mask`` — builds the causal mask with ``device="cuda"``
  when an attention layer gets ``attention_mask=None``; rebuilt on CPU.
* ``WrappedTorchNorm`` (the norm Megatron falls back to without Apex/TE) asserts
  ``not sequence_parallel``. A torch norm is correct under sequence parallelism as long
  as its weight gradients are summed over the TP group, so the shim builds the same
  ``torch.nn.RMSNorm``/``LayerNorm`` and marks its parameters ``sequence_parallel``
  (Megatron's ``finalize_model_grads`` then all-reduces them over TP).
* ``megatron.core.utils.is_te_min_version`` — raises ``TypeError`` when Transformer Engine
  is absent; made to answer ``False``.
* ``moe_utils.te_general_gemm`` — megatron-core 0.16's MoE router gate
  (``router_gating_linear``) tests ``te_general_gemm is not None``, but the name is only
  defined when Transformer Engine imports: defined as ``None`` (the torch path). Without it
  every MoE forward raises ``NameError``.
* ``torch.cuda.Stream`` / ``torch.cuda.stream`` — the MoE all-to-all token dispatcher
  (expert parallelism) creates a side stream for its device-to-host copies at
  construction and enters it, records an event and synchronizes on it every forward: the
  CPU's one implicit stream stands in (:class:`_CpuStream`; its events do nothing).
* ``token_dispatcher.maybe_move_tensor_to_cpu`` — the all-to-all dispatcher moves its
  split sizes to the host "as numpy" only when they are CUDA tensors; on CPU they stay
  tensors, which ``torch.distributed.all_to_all_single`` rejects as split sizes. The shim
  converts host tensors too when numpy is asked for (what the GPU path returns).

* ``ssm.gated_delta_net.common.l2norm`` (megatron-core >= 0.19, with flash-linear-attention
  installed) — GatedDeltaNet normalises queries and keys with FLA's Triton ``l2norm``,
  which has no CPU backend: replaced by the same formula in torch
  (``x / sqrt(sum(x^2) + eps)`` in float32, eps 1e-6, FLA's defaults). The layer's other
  FLA kernels (convolution, chunked delta rule) are not used on CPU:
  ``TransformerConfig(deterministic_mode=True)`` selects Megatron's own torch kernels.
* ``_GDNBase._prepare_input_for_gated_delta_rule`` / ``_apply_gated_norm`` /
  ``_compute_g_and_beta`` are wrapped in ``torch.compile`` (Megatron's ``jit_fuser``) at
  import; on CPU inductor compiles C++ for every new sequence length (8-12 s a call on
  this machine): the eager functions under them run instead (same operations).
* ``models.hybrid.hybrid_block.TENorm`` (megatron-core 0.19, without Transformer Engine) —
  ``HybridStack`` builds its final norm with ``TENorm`` whatever its spec says, which
  raises ``ImportError`` without TE: Megatron's own torch norm (``WrappedTorchNorm``, the
  same ``weight``) is built instead, so ``HybridModel`` runs on the local modules.

Two scoped context managers add what else a caller needs: :func:`cuda_factories_on_cpu`
(``device="cuda"`` factories and CUDA type checks in megatron-core's schedules and
optimizers) and :func:`megatron_lm_on_cpu` (Megatron-LM's own training loop, each shim
with its reason in its docstring).

Remove a shim when the upstream version it names no longer needs it.
"""

from __future__ import annotations

import contextlib
from typing import List

import torch
from torch.overrides import TorchFunctionMode

from megatron_branch._deps import HAVE_TE

_APPLIED: List[str] = []


class CpuRNGStatesTracker:
    """Named RNG streams on the CPU generator, API-compatible with Megatron's tracker."""

    def __init__(self, *args, **kwargs):
        self.states_ = {}
        self.seeds_ = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        gen = torch.Generator().manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _no_sync(*args, **kwargs) -> None:
    return None


class _CpuEvent:
    """An event on the CPU's implicit stream: already complete."""

    def synchronize(self) -> None:
        return None

    def wait(self, *args, **kwargs) -> None:
        return None

    def query(self) -> bool:
        return True


class _CpuStream:
    """The CPU's single implicit stream: waiting on it or recording into it is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs) -> None:
        return None

    def wait_stream(self, *args, **kwargs) -> None:
        return None

    def record_event(self, *args, **kwargs) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        return None


def enable_cpu(seed: int = 1234) -> List[str]:
    """Make megatron-core's GPTModel runnable on CPU (idempotent; no-op with CUDA).

    Args:
        seed: seed of the model-parallel RNG stream registered in the CPU tracker.

    Returns:
        The names of the shims in effect (empty where CUDA is available).
    """
    if torch.cuda.is_available():
        return []
    if _APPLIED:
        return list(_APPLIED)

    torch.cuda.current_device = _cpu_device
    _APPLIED.append("torch.cuda.current_device->cpu")
    torch.cuda.synchronize = _no_sync
    _APPLIED.append("torch.cuda.synchronize->noop")
    torch.cuda.current_stream = lambda *args, **kwargs: _CpuStream()
    _APPLIED.append("torch.cuda.current_stream->CPU stream (no-op waits)")

    from megatron.core import utils as mcore_utils
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = CpuRNGStatesTracker()
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed + 1)
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 2)
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _APPLIED.append("tensor_parallel.random tracker->CpuRNGStatesTracker")
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: None
    mcore_random._set_cuda_rng_state = lambda *args, **kwargs: None
    _APPLIED.append("tensor_parallel.random._get/_set_cuda_rng_state->noop")

    from functools import lru_cache

    from megatron.core.fusions import fused_softmax

    @lru_cache(maxsize=32)
    def _cpu_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    _APPLIED.append("fused_softmax.get_default_causal_mask->cpu")

    from megatron.core.transformer import torch_norm

    if not getattr(torch_norm.WrappedTorchNorm, "_megatron_branch_sp", False):
        original_new = torch_norm.WrappedTorchNorm.__new__

        def _norm_new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
            if not config.sequence_parallel:
                return original_new(cls, config, hidden_size, eps, *args, **kwargs)
            norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
            norm = norm_cls(normalized_shape=hidden_size, eps=eps)
            for p in norm.parameters():
                p.sequence_parallel = True
            return norm

        torch_norm.WrappedTorchNorm.__new__ = _norm_new
        torch_norm.WrappedTorchNorm._megatron_branch_sp = True
    _APPLIED.append("WrappedTorchNorm: sequence parallel allowed (params marked)")

    if not HAVE_TE:
        mcore_utils.is_te_min_version = lambda *a, **k: False
        _APPLIED.append("utils.is_te_min_version->False")

    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _APPLIED.append("moe_utils.te_general_gemm->None")
    torch.cuda.Stream = _CpuStream
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    _APPLIED.append("torch.cuda.Stream/stream->CPU stream (MoE all-to-all dispatcher)")
    from megatron.core.transformer.moe import token_dispatcher

    original_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu

    def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    _APPLIED.append("token_dispatcher.maybe_move_tensor_to_cpu: host split sizes as numpy")
    _gdn_on_cpu()
    return list(_APPLIED)


def _torch_l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype=None) -> torch.Tensor:
    """FLA's ``l2norm`` in torch: ``x / sqrt(sum(x^2) + eps)`` over the last dim, in float32."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(output_dtype or x.dtype)


def _gdn_on_cpu() -> None:
    # megatron-core is imported only when the shims are applied
    from megatron_branch._megatron import gdn_common, hybrid_block

    if gdn_common is None:  # megatron-core 0.16: no GatedDeltaNet
        return
    if hybrid_block is not None and not HAVE_TE:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        hybrid_block.TENorm = WrappedTorchNorm
        _APPLIED.append("hybrid_block.TENorm->WrappedTorchNorm (HybridStack's final norm without TE)")
    if getattr(gdn_common, "HAVE_FLA", False):
        gdn_common.l2norm = _torch_l2norm
        _APPLIED.append("gated_delta_net.common.l2norm->torch (FLA's Triton kernel has no CPU backend)")
    base = gdn_common._GDNBase
    for name in ("_prepare_input_for_gated_delta_rule", "_apply_gated_norm", "_compute_g_and_beta"):
        fn = base.__dict__.get(name)
        eager = getattr(fn, "_torchdynamo_orig_callable", None)
        if eager is not None:
            setattr(base, name, eager)
            _APPLIED.append(f"_GDNBase.{name}: eager (torch.compile recompiles per length on CPU)")


class _CudaFactoriesOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and not isinstance(device, int) and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if kwargs.get("pin_memory") and not torch.cuda.is_available():
            kwargs["pin_memory"] = False  # pinning speeds host-to-GPU copies only; no allocator here
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str):
            # megatron's optimizers check ``param.type() == 'torch.cuda.FloatTensor'``
            return out.replace("torch.", "torch.cuda.", 1) if not out.startswith("torch.cuda.") else out
        return out


@contextlib.contextmanager
def cuda_factories_on_cpu():
    """Inside, tensors that megatron code creates with ``device="cuda"`` (or ``.cuda()``)
    stay on the CPU, and ``tensor.type()`` answers with CUDA type names; a no-op where
    CUDA is available.

    Scoped, for the megatron-core calls that assume a GPU:

    * the pipeline schedules allocate a token counter with a literal ``device="cuda"``
      (``megatron_branch.training.schedule`` wraps them);
    * Megatron's optimizers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
      ``DistributedOptimizer``, the grad scalers, ``clip_grad_by_total_norm_fp32``)
      allocate their flags and norms with ``device='cuda'`` and check
      ``param.type() == 'torch.cuda.FloatTensor'`` (and the bf16/fp16 names) before they
      accept a parameter; ``megatron_branch.training`` wraps construction and ``step``;
    * ``finalize_model_grads`` under the per-token loss;
    * YaRN rotary embeddings under context parallelism (multi-latent attention): their
      constructor slices a cached table with ``get_pos_emb_on_this_cp_rank``, whose index
      tensor asks for ``pin_memory=True`` (dropped: there is no accelerator to copy to).
    """
    if torch.cuda.is_available():
        yield
        return
    with _CudaFactoriesOnCpu():
        yield


def cpu_enabled() -> bool:
    """True once :func:`enable_cpu` has patched this process."""
    return bool(_APPLIED)


_MISSING = object()


@contextlib.contextmanager
def _counts_one_device():
    saved = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = saved


@contextlib.contextmanager
def megatron_lm_on_cpu():
    """Run Megatron-LM's training loop (``megatron.training.pretrain``) on a machine
    without CUDA, over gloo; a no-op where CUDA is available.

    Scoped: everything below is undone on exit. It adds to :func:`enable_cpu` (which it
    calls, and which stays in effect) and :func:`cuda_factories_on_cpu` (entered for the
    duration) the places where Megatron-LM ``core_v0.16.1`` itself assumes a GPU:

    * ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless
      ``allow_no_cuda=True``, which ``pretrain`` never passes: ``training.initialize_megatron``
      is wrapped to pass it.
    * the rerun state machine saves and restores ``torch.cuda.get_rng_state()`` every
      iteration: ``torch.cuda.get_rng_state`` / ``set_rng_state`` hold an empty state
      (the CPU generator is saved by the same code).
    * ``_initialize_distributed`` creates the model-parallel groups
      (``initialize_model_parallel``) only if ``torch.cuda.device_count() > 0``: during
      that call it counts one device and ``torch.cuda.set_device`` does nothing.
    * ``_compile_dependencies`` builds the C++ dataset index helpers (``make`` with
      pybind11; only Megatron's indexed datasets need them, not an external data loader)
      and loads the CUDA fused kernels (``nvcc``): skipped.
    * ``get_model``'s DDP wrapping (``_ddp_wrap``) runs on a side stream
      (``torch.cuda.Stream``, ``torch.cuda.stream``, ``current_stream``): the CPU's one
      implicit stream stands in.
    * ``torch.cuda.nvtx.range_push`` / ``range_pop`` (Megatron-RL's ``get_nvtx_range``
      in ``get_logprobs`` and ``prepare_data_for_update``, ``--profile``) raise without
      CUDA: made no-ops.
    * ``moe_utils.te_general_gemm`` is referenced by the MoE router without Transformer
      Engine but only defined with it: defined as ``None`` (the torch path).
    * ``model.cuda()``, ``device='cuda'`` factories (flags, timers, loss reductions,
      Megatron-RL's advantages) and the optimizers' CUDA type checks, gradient clipping
      (``--clip-grad``) included: :func:`cuda_factories_on_cpu`.

    Yields:
        The names of the shims in effect (empty where CUDA is available).
    """
    if torch.cuda.is_available():
        yield []
        return
    import megatron.training.initialize as mlm_initialize
    import megatron.training.training as mlm_training

    applied = enable_cpu()
    saved = {}

    def patch(owner, name: str, value, label: str) -> None:
        saved[(owner, name)] = getattr(owner, name, _MISSING)
        setattr(owner, name, value)
        applied.append(label)

    original_init = mlm_training.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    patch(mlm_training, "initialize_megatron", initialize_megatron, "training.initialize_megatron(allow_no_cuda=True)")
    original_dist = mlm_initialize._initialize_distributed

    def initialize_distributed(*args, **kwargs):
        # Megatron-LM builds the model-parallel groups only when it counts a GPU.
        with _counts_one_device():
            return original_dist(*args, **kwargs)

    patch(mlm_initialize, "_initialize_distributed", initialize_distributed,
          "initialize._initialize_distributed: model-parallel groups without a GPU")
    patch(mlm_initialize, "_compile_dependencies", lambda: None, "initialize._compile_dependencies->skipped")
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        patch(moe_utils, "te_general_gemm", None, "moe_utils.te_general_gemm->None")
    patch(torch.cuda, "get_rng_state", lambda *a, **k: torch.empty(0, dtype=torch.uint8),
          "torch.cuda.get_rng_state->empty")
    patch(torch.cuda, "set_rng_state", lambda *a, **k: None, "torch.cuda.set_rng_state->noop")
    patch(torch.cuda, "Stream", lambda *a, **k: _CpuStream(), "torch.cuda.Stream->CPU stream")
    patch(torch.cuda, "current_stream", lambda *a, **k: _CpuStream(), "torch.cuda.current_stream->CPU stream")
    patch(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext(), "torch.cuda.stream->nullcontext")
    patch(torch.cuda.nvtx, "range_push", lambda *a, **k: None, "torch.cuda.nvtx.range_push->noop")
    patch(torch.cuda.nvtx, "range_pop", lambda *a, **k: None, "torch.cuda.nvtx.range_pop->noop")
    try:
        with cuda_factories_on_cpu():
            yield list(applied)
    finally:
        for (owner, name), value in saved.items():
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
