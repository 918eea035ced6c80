"""Scoped shims of megatron-core's dist-checkpointing and distributed-optimizer internals.

Each is a function or context manager the checkpoint code calls around one Megatron
call (never applied on import), with why it is needed and when it can go:

* :class:`InProcessSaveStrategy`: Megatron's ``torch_dist`` writer starts a
  ``multiprocessing`` manager process for its result queue and, in megatron-core 0.16,
  forks one writer process per file, which a SIGKILLed trainer orphans. The same format is
  written by the calling process instead (the strategy's own write function per file, in
  turn, with in-process queues). :func:`in_process_writer_available` says whether the
  internals it relies on are there (otherwise the stock strategy is used).
* :func:`materialize_adam_state`, :func:`adam_step_kept_on_load`,
  :func:`unshare_adam_steps`: the distributed optimizer over torch Adam (no Apex/TE) saves
  and loads ``fully_reshardable`` state correctly (megatron-core 0.16.1 and 0.19.2).

Like :mod:`megatron_branch.cpu`, this module writes private attributes of megatron-core
objects on purpose; the package's layering test allows it here only.
"""

from __future__ import annotations

import contextlib
import functools
import queue
from typing import Any

import torch

from megatron_branch._megatron import TorchDistSaveShardedStrategy
from megatron_branch._megatron import filesystem_async as _fs_async


@contextlib.contextmanager
def _in_process_results_queue():
    """Megatron's writer gets its result queue from a module global it creates lazily
    with ``multiprocessing.get_context("spawn").Manager()`` (a server process): hand it an
    in-process queue instead while the save is planned."""
    saved = getattr(_fs_async, "_results_queue", None)
    _fs_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        _fs_async._results_queue = saved


def _write_buckets_in_process(transform_list, use_msc, rank, write_buckets, results_queue) -> None:
    """What ``write_preloaded_data_multiproc`` / ``..._multithread`` do, in this process:
    each file written in turn by the writer's own ``write_preloaded_data``."""
    results: Any = {}
    for i, bucket in enumerate(write_buckets):
        local, count = queue.Queue(), queue.Queue()
        count.put(i)
        extra = {"use_msc": use_msc} if use_msc else {}
        _fs_async.FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True, **extra)
        idx, out = local.get_nowait()
        if isinstance(out, Exception):
            results = out
            break
        results[idx] = out
    results_queue.put(results)


def in_process_writer_available() -> bool:
    writer = getattr(_fs_async, "FileSystemWriterAsync", None)
    return writer is not None and hasattr(writer, "write_preloaded_data") and hasattr(_fs_async, "_results_queue")


class InProcessSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron's ``torch_dist`` save strategy, written synchronously by the calling
    process: no manager process, no forked writers (same files, same format)."""

    def __init__(self):
        super().__init__("torch_dist", 1, thread_count=1)

    def async_save(self, *args, **kwargs):
        with _in_process_results_queue():
            request = super().async_save(*args, **kwargs)
        fn = request.async_fn
        if fn is None:  # nothing to write on this rank
            return request
        if not (isinstance(fn, functools.partial) and len(fn.args) == 2):
            raise RuntimeError("megatron_branch: unexpected dist_checkpointing writer function "
                               f"{fn!r}; this megatron-core release needs InProcessSaveStrategy updated")
        return request._replace(async_fn=functools.partial(_write_buckets_in_process, *fn.args))


def materialize_adam_state(optimizer) -> None:
    """Give every parameter of a torch Adam/AdamW inside a Megatron optimizer the state
    its first ``step`` would create (zero moments, ``step`` 0), where it has none.

    Without Apex/Transformer Engine, ``DistributedOptimizer.state_dict`` (called by its
    ``sharded_state_dict``, for saving and loading alike) reads ``state["step"]`` of every
    parameter, so a freshly built optimizer could neither be saved nor loaded into.
    Adam's first step does the same thing to an empty or a zero state, so this changes
    no result.
    """
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(leaf, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if len(state) == 0:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


@contextlib.contextmanager
def adam_step_kept_on_load(optimizer):
    """Scoped, per-instance: let a distributed optimizer over torch Adam load a
    ``fully_reshardable`` state (megatron-core 0.16.1 and 0.19.2, without Apex/TE).

    ``DistributedOptimizer.load_state_dict`` first sets Adam's ``step`` (from the saved
    param groups) into every parameter's state, then copies each state key from the
    loaded per-parameter tensors, which carry no ``step`` (it is kept in the param
    groups): ``KeyError: 'step'``. The wrapper hands the step just set back in, so the copy
    is a no-op for it. Remove when ``_set_main_param_and_optimizer_states`` skips keys the
    loaded tensors lack.
    """
    patched = []
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = getattr(type(leaf), "_set_main_param_and_optimizer_states", None)
        index = getattr(leaf, "model_param_group_index_map", None)
        if original is None or index is None:
            continue

        def keep_step(model_param, tensors, _leaf=leaf, _original=original, _index=index):
            if "step" not in tensors:
                group, order = _index[model_param]
                main = _leaf.optimizer.param_groups[group]["params"][order]
                step = _leaf.optimizer.state[main].get("step")
                if step is not None:
                    tensors = {**tensors, "step": step}
            return _original(_leaf, model_param, tensors)

        leaf._set_main_param_and_optimizer_states = keep_step
        patched.append(leaf)
    try:
        yield
    finally:
        for leaf in patched:
            del leaf._set_main_param_and_optimizer_states


def unshare_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam ``step`` tensor after a load.

    Without Apex/TE, ``DistributedOptimizer.load_state_dict`` (megatron-core 0.16.1,
    0.19.2) puts *one* step tensor into every parameter's state and torch's
    ``Optimizer.load_state_dict`` keeps it shared (it does not copy ``step``); Adam then
    increments the shared tensor once per parameter each step and the bias correction of
    every later step is wrong. A clone per parameter restores what training had.
    """
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(leaf, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        seen = set()
        for state in inner.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if torch.is_tensor(step):
                if id(step) in seen:
                    state["step"] = step.clone()
                seen.add(id(state["step"]))
