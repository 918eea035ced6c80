"""The model handle: what every layer of the package needs to know about a model object.

A model reaches the package as a ``GPTModel``, possibly wrapped (``Float16Module``,
Megatron's ``DistributedDataParallel``), or as Megatron's list of model chunks (virtual
pipeline stages). This module unwraps it, finds its device, reads its gradients where
Megatron DDP keeps them (``main_grad``), refuses the wrappers branch replay cannot drive,
and holds Megatron DDP's bucket reduction over the several backwards of one replay step
(:class:`GradSync`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Union

import torch

from megatron_branch._megatron import DistributedDataParallel, TransformerConfig

Chunks = Union[torch.nn.Module, Sequence[torch.nn.Module]]

# The host, for bookkeeping tensors the package keeps there on purpose (tree indices, plans)
# and moves to the model's device explicitly. Tensors for the model's side are created on
# ``model_device(model)``; the device tests tell the two apart by this object's identity.
HOST = torch.device("cpu")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost module under ``Float16Module`` / DDP wrappers (their ``.module``).

    Raises:
        ValueError: ``model`` is a ``(model, config)`` pair (:func:`as_chunks`).
    """
    if isinstance(model, (list, tuple)):
        _refuse_model_config_pair(model)
    while hasattr(model, "module"):
        model = model.module
    return model


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's parameters."""
    return next(model.parameters()).device


def as_chunks(model: Chunks) -> List[torch.nn.Module]:
    """``model`` as Megatron's list of model chunks (a module becomes ``[module]``).

    Raises:
        ValueError: an empty list, or a sequence holding a ``TransformerConfig`` (the
            ``(model, config)`` pair that :func:`megatron_branch.hf.load_gpt_from_hf` returns).
    """
    if isinstance(model, (list, tuple)):
        if not model:
            raise ValueError("model: an empty list of model chunks")
        _refuse_model_config_pair(model)
        return list(model)
    return [model]


def _refuse_model_config_pair(chunks: Sequence) -> None:
    # A (model, config) pair would otherwise pass as two virtual-pipeline chunks and fail
    # later with a misleading chunk-count error; a config is never a model chunk.
    config = next((c for c in chunks if isinstance(c, TransformerConfig)), None)
    if config is not None:
        raise ValueError(
            f"model: got a {type(chunks).__name__} holding a {type(config).__name__}, not model chunks; "
            "mb.hf.load_gpt_from_hf and build_from_hf_config return (model, config): pass the model, "
            "e.g. model, config = mb.hf.load_gpt_from_hf(hf_dir)"
        )


def single_chunk(model: Chunks, what: str) -> torch.nn.Module:
    """The one model chunk of ``model``; virtual-pipeline chunk lists belong to the schedules."""
    chunks = as_chunks(model)
    if len(chunks) != 1:
        raise ValueError(
            f"model: {what} takes one model chunk, got {len(chunks)} (virtual pipeline stages run "
            f"through megatron_branch.training.schedule.forward_backward)"
        )
    check_wrapper(chunks[0])
    return chunks[0]


def check_wrapper(model: torch.nn.Module) -> None:
    """Refuse wrappers whose gradient reduction branch replay cannot control.

    torch's ``DistributedDataParallel`` all-reduces after *every* backward and FSDP shards
    parameters outside Megatron's buffers; replay runs several backwards per step, so both
    would reduce partial gradients. Megatron's DDP is the supported wrapper.
    """
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    m = model
    while m is not None:
        if isinstance(m, TorchDDP):
            raise ValueError(
                "model: torch.nn.parallel.DistributedDataParallel reduces gradients after every "
                "backward; wrap the model in megatron.core.distributed.DistributedDataParallel "
                "(megatron_branch.training.wrap_ddp) instead"
            )
        kind = type(m).__name__
        if kind in ("FullyShardedDataParallel", "FSDPModule") or kind.startswith("FSDP"):
            raise ValueError(
                f"model: {kind} (torch FSDP) is not supported by branch replay; wrap the model in "
                "megatron.core.distributed.DistributedDataParallel (megatron_branch.training.wrap_ddp)"
            )
        m = getattr(m, "module", None)


def is_megatron_ddp(model: torch.nn.Module) -> bool:
    """Whether ``model`` is wrapped in Megatron's ``DistributedDataParallel``."""
    return isinstance(model, DistributedDataParallel)


def param_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The accumulated gradient of ``p``: Megatron DDP's ``main_grad`` or torch's ``.grad``."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def _bucket_groups(model: Chunks):
    for chunk in as_chunks(model):
        if is_megatron_ddp(chunk):
            yield from chunk.bucket_groups + chunk.expert_parallel_bucket_groups


def sync_enabled(model: Chunks) -> bool:
    """False inside ``no_sync()`` (a micro-batch that is not the step's last)."""
    return all(bg.is_last_microbatch for bg in _bucket_groups(model))


class GradSync:
    """Controls Megatron DDP's reduction over the several backwards of one replay.

    Megatron DDP reduces a bucket as soon as every parameter in it has reported its
    gradient in the micro-batch not run under ``no_sync`` (with ``overlap_grad_reduce``),
    or at ``finish_grad_sync``. Branch replay may run several backwards for one
    micro-batch (one per streaming chunk, one per stem): ``hold()`` wraps every backward
    but the final one, which runs as the caller left it (reducing if this is the step's
    last micro-batch, held if the caller is inside ``no_sync()``). A no-op for unwrapped
    models.
    """

    def __init__(self, model: Chunks):
        self.chunks = [c for c in as_chunks(model) if is_megatron_ddp(c)]
        self.active = bool(self.chunks) and sync_enabled(self.chunks)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        if not self.active:
            yield
            return
        with contextlib.ExitStack() as stack:
            for chunk in self.chunks:
                stack.enter_context(chunk.no_sync())
            yield


# Where Transformer Engine's modules live: TE itself, and Megatron's wrappers of it.
_TE_MODULES = ("transformer_engine", "megatron.core.extensions.transformer_engine")


def is_te_module(module: torch.nn.Module) -> bool:
    """``module`` is a Transformer Engine layer (or Megatron's wrapper of one); by its
    class's module name, so no TE import is needed on a machine without it."""
    return type(module).__module__.startswith(_TE_MODULES)


def low_precision_error(model: torch.nn.Module, has_te: bool) -> Optional[str]:
    """Why ``model`` cannot honour its config's ``fp8`` / ``fp4`` (None if it can): only
    Transformer Engine's linears run FP8 GEMMs; the local spec's would run in full
    precision without a word."""
    config = getattr(unwrap(model), "config", None)
    for option in ("fp8", "fp4"):
        value = getattr(config, option, None)
        if value and not has_te:
            return (f"{option}: TransformerConfig.{option}={value!r} but the model has no Transformer Engine linear "
                    "layers, so it would run in full precision; build it with get_branch_layer_spec(use_te=True) "
                    "on a machine with TE, or emulate FP8 with megatron_branch.integrations.fp8.emulate_fp8")
    return None


def refresh_fp8_weights(model: Chunks) -> None:
    """Have Transformer Engine recast its FP8 weights at the next forward.

    TE linears cache their weights' FP8 casts after the first micro-batch of a step and
    only recast them when ``is_first_microbatch`` is set again, which Megatron's schedules
    do (``set_is_first_microbatch()``). The package's own loops (``rollout_logprobs``,
    ``replay_step`` and what runs on them) call the model directly, so they call this
    before their first forward: without it every step after the first would compute with
    the first step's FP8 weights. A no-op without FP8 (Megatron's method checks the config).
    """
    for chunk in as_chunks(model):
        target = chunk if hasattr(chunk, "set_is_first_microbatch") else unwrap(chunk)
        if hasattr(target, "set_is_first_microbatch"):
            target.set_is_first_microbatch()
