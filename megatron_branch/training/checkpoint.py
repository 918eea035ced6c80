"""Checkpoint and resume through Megatron's ``dist_checkpointing``, saved atomically.

    save_checkpoint(DIR, iteration, [ddp], optimizer, data_state={"consumed_batches": 2})
    loaded = load_checkpoint(DIR, [ddp], optimizer)      # -> LoadedCheckpoint(iteration=2, ...)

What a checkpoint holds (``DIR/iter_0000002/``):

* the model chunks' ``sharded_state_dict()`` (Megatron DDP / ``Float16Module`` wrapped or
  not) under ``model`` (``model0``, ``model1``, ... for virtual-pipeline chunks), as
  Megatron-LM saves them;
* the Megatron optimizer's ``sharded_state_dict(model_state)``: Adam moments, fp32 main
  parameters, step counts; the distributed optimizer's shards in the
  ``fully_sharded_model_space`` format (one ``ShardedTensor`` per parameter), so a
  checkpoint loads on a different TP/PP/DP layout (dist-ckpt resharding);
* every rank's RNG state (torch CPU and CUDA generators, Megatron's model-parallel RNG
  tracker — :class:`megatron_branch.cpu.CpuRNGStatesTracker` on CPU — Python's and
  numpy's) as one ``ShardedObject`` per rank; restored only on the same layout (another
  layout's ranks have other streams, as in Megatron-LM);
* ``train_state.json``: the iteration, the caller's data position, the layout, the
  model fingerprint (refused on mismatch) and the writer used.

**Atomic save** (the package's one convention, :mod:`megatron_branch.atomic`). Every rank
writes into ``DIR/.iter_XXXXXXX.tmp-<pid>-<start>-<host>-<random>`` (named after rank 0's
process); once all ranks are done and ``train_state.json`` is written, rank 0 renames the
directory to ``DIR/iter_XXXXXXX`` and replaces ``DIR/latest`` (the iteration number) with
``os.replace`` of a temporary file, fsyncing files and the directory. A save killed at any
point leaves ``latest`` naming the previous complete checkpoint; half-written temporary
entries are ignored and removed by the next :func:`load_checkpoint`. Saving an iteration
that already exists moves the old copy aside first (``.iter_XXXXXXX.old-...``); a kill
between that move and the rename is mended by the next load, which puts it back.

**Writer.** Megatron's ``torch_dist`` writer (``FileSystemWriterAsync``) starts a
``multiprocessing`` manager process for its result queue and, in megatron-core 0.16,
forks one writer process per file — a SIGKILLed trainer orphans them. Here the same
format is written synchronously by the calling process
(:class:`InProcessSaveStrategy`: the strategy's own write function per file, in turn,
with in-process queues), so no process is started. If a megatron-core release changes
the internals it relies on, the stock strategy is used and ``train_state.json`` says so.
Loading uses Megatron's default ``torch_dist`` load strategy (in process).
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_branch._megatron import (
    MegatronOptimizer,
    ShardedObject,
    dist_checkpointing,
    tensor_parallel,
)
from megatron_branch.atomic import (
    clean_stale_temps,
    fsync_dir,
    make_temp_dir,
    publish_dir,
    stale_temps,
    write_text_atomically,
)
from megatron_branch.cpu import cuda_factories_on_cpu
from megatron_branch.layout import ParallelLayout
from megatron_branch.model import as_chunks, unwrap
from megatron_branch.training.dist_ckpt_shims import (
    InProcessSaveStrategy,
    adam_step_kept_on_load,
    in_process_writer_available,
    materialize_adam_state,
    unshare_adam_steps,
)

FORMAT_VERSION = 1
LATEST = "latest"
STATE_FILE = "train_state.json"
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
_ITER = re.compile(r"^iter_(\d{7})$")


def iteration_dir(directory: str, iteration: int) -> str:
    """``DIR/iter_XXXXXXX`` (Megatron-LM's naming)."""
    return os.path.join(directory, f"iter_{iteration:07d}")


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored.

    Attributes:
        iteration: the step the checkpoint was saved after (steps already done).
        data_state: the caller's data position, as passed to :func:`save_checkpoint`.
        path: the iteration directory loaded.
        rng_restored: False when the layout differs from the saving run's (RNG streams
            are per rank, so they start from the seed instead).
        layout: the saving run's ``{"world", "tp", "pp", "cp", "dp"}``.
        removed_temp: stale ``*.tmp-*`` entries of interrupted saves that were removed.
    """

    iteration: int
    data_state: Dict[str, Any]
    path: str
    rng_restored: bool
    layout: Dict[str, int]
    removed_temp: List[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- checks
def latest_iteration(directory: str) -> Optional[int]:
    """The iteration ``DIR/latest`` names, or None when there is no ``latest``.

    Raises:
        ValueError: ``latest`` does not hold an iteration number, or its directory is missing.
    """
    path = os.path.join(directory, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{path}: holds {text[:40]!r}, not an iteration number; the checkpoint "
                         f"directory is corrupt (point it at an iter_XXXXXXX by writing its number there)")
    iteration = int(text)
    if not os.path.isdir(iteration_dir(directory, iteration)):
        raise ValueError(f"{path}: names iteration {iteration} but {iteration_dir(directory, iteration)} "
                         f"is missing; restore it or write an existing iteration's number into {path}")
    return iteration


def check_load_dir(directory: str) -> int:
    """Check before any heavy work that ``directory`` holds a loadable checkpoint.

    Returns:
        The iteration ``latest`` names.

    Raises:
        FileNotFoundError: no such directory, or no ``latest`` in it.
        ValueError: ``latest`` or the checkpoint's ``train_state.json`` is corrupt.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--load {directory}: no such directory; pass the --save directory "
                                f"of an earlier run")
    iteration = latest_iteration(directory)
    if iteration is None:
        raise FileNotFoundError(f"--load {directory}: holds no checkpoint (no {LATEST} file); pass the "
                                f"--save directory of an earlier run")
    read_train_state(iteration_dir(directory, iteration))
    return iteration


def _need_psutil(flag: str) -> None:
    try:
        import psutil  # noqa: F401 - megatron-core's checkpoint writer measures memory with it
    except ImportError:
        raise ImportError(f"{flag}: megatron-core's checkpoint writer needs psutil; pip install psutil") from None


def check_save_dir(directory: str, *, resume_from: Optional[str] = None) -> None:
    """Check before any heavy work that checkpoints can be written to ``directory``.

    The directory is created if needed. One that already holds checkpoints is accepted
    only when it is the directory the run resumes from (``resume_from``), so an unrelated
    run's checkpoints are never overwritten.

    Raises:
        ValueError: ``directory`` is a file, or holds another run's checkpoints.
        OSError: it cannot be created or written to.
        ImportError: psutil (needed by megatron-core's writer) is missing.
    """
    _need_psutil(f"--save {directory}")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"--save {directory}: is a file, not a directory; choose a directory")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise OSError(f"--save {directory}: cannot create it ({e.strerror}); choose a writable directory") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OSError(f"--save {directory}: not writable; choose a writable directory")
    held = latest_iteration(directory) if os.path.isfile(os.path.join(directory, LATEST)) else None
    same = resume_from is not None and os.path.realpath(resume_from) == os.path.realpath(directory)
    if held is not None and not same:
        raise ValueError(f"--save {directory}: already holds checkpoints (latest iteration {held}); "
                         f"resume with --load {directory} or choose an empty directory")


def read_train_state(path: str) -> Dict[str, Any]:
    """``train_state.json`` of the iteration directory ``path``.

    Raises:
        FileNotFoundError: the file is missing (not a checkpoint of this package).
        ValueError: it is not valid JSON or lacks the fields this version writes.
    """
    file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: missing; {path} is not a complete megatron_branch checkpoint")
    try:
        with open(file) as f:
            state = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: corrupt ({e}); load an earlier iteration") from None
    missing = [k for k in ("format_version", "iteration", "layout") if k not in state]
    if missing:
        raise ValueError(f"{file}: lacks {', '.join(missing)}; not a checkpoint of this version")
    if state["format_version"] > FORMAT_VERSION:
        raise ValueError(f"{file}: format version {state['format_version']} is newer than this "
                         f"megatron_branch reads ({FORMAT_VERSION}); upgrade megatron_branch")
    return state


def _save_strategy():
    if in_process_writer_available():
        return InProcessSaveStrategy(), "in-process torch_dist (no writer processes)"
    return None, "megatron default torch_dist (writer processes)"


def save_sharded(state: Dict[str, Any], directory: str) -> str:
    """``dist_checkpointing.save(state, directory)`` written by the calling process
    (:class:`InProcessSaveStrategy`; the stock strategy if this megatron-core lacks what
    it relies on), so a killed process leaves no writer behind. Collective, like
    ``dist_checkpointing.save``. Used by :func:`save_checkpoint` and the checkpoint
    converter (:mod:`megatron_branch.hf.convert`).

    Returns:
        The writer used, in words (recorded next to the checkpoint).
    """
    strategy, writer = _save_strategy()
    dist_checkpointing.save(state, directory, sharded_strategy=strategy)  # ends with a barrier
    return writer


# ------------------------------------------------------------------------ state dicts
def _layout() -> Dict[str, int]:
    return ParallelLayout.current().sizes()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state() -> Dict[str, Any]:
    """This process's RNG state: torch CPU (and CUDA) generators, Megatron's RNG
    tracker streams, Python's ``random`` and numpy's global generator."""
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _chunk_key(index: int, count: int) -> str:
    return "model" if count == 1 else f"model{index}"


def _sharded_state(chunks, optimizer, *, is_loading: bool, rng: Optional[Dict[str, Any]], layout):
    state: Dict[str, Any] = {}
    for i, chunk in enumerate(chunks):
        # the bare GPTModel, as Megatron-LM's unwrap_model: stock keys, whatever the wrappers
        state[_chunk_key(i, len(chunks))] = unwrap(chunk).sharded_state_dict(metadata=dict(OPTIMIZER_SHARDING))
    if optimizer is not None:
        materialize_adam_state(optimizer)
        with cuda_factories_on_cpu():  # the distributed optimizer gathers through device="cuda" buffers
            state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                              metadata=dict(OPTIMIZER_SHARDING))
    if rng is not None:
        state["rng_state"] = ShardedObject("megatron_branch.rng_state", rng, (layout["world"],), (_rank(),),
                                           replica_id=0)
    return state


def _optimizer_kinds(optimizer) -> Optional[List[str]]:
    """Class names of the Megatron optimizers (chained ones listed): their sharded
    states differ (fp32 main parameters, distributed shards), so they must match on load."""
    if optimizer is None:
        return None
    return [type(leaf).__name__ for leaf in getattr(optimizer, "chained_optimizers", [optimizer])]


def _check_optimizer(optimizer) -> None:
    if optimizer is not None and not isinstance(optimizer, MegatronOptimizer):
        raise ValueError(
            f"optimizer: {type(optimizer).__name__} has no sharded state dict; checkpointing needs a Megatron "
            "optimizer (megatron_branch.training.get_optimizer)"
        )


def _broadcast(obj):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def remove_stale_temp(directory: str) -> List[str]:
    """Remove the leftovers of interrupted saves in ``directory`` (their writer gone, or
    this process: call it when no save is running), put back an iteration a killed
    re-save had moved aside; returns the names removed or restored."""
    stale = stale_temps(directory, own_process=True)
    clean_stale_temps(stale, what="save", replacement="re-save", report=lambda line: None)
    return [os.path.basename(path) for path, _, _ in stale]


# ------------------------------------------------------------------------ save / load
def save_checkpoint(
    directory: str,
    iteration: int,
    model,
    optimizer: Optional[MegatronOptimizer] = None,
    *,
    data_state: Optional[Dict[str, Any]] = None,
    fingerprint: Optional[Dict[str, Any]] = None,
    before_commit: Optional[Callable[[str], None]] = None,
) -> str:
    """Save model, optimizer, RNG and train state after ``iteration`` steps, atomically.

    Collective: every rank of the default process group calls it.

    Args:
        directory: the checkpoint root (created if needed).
        iteration: steps done; the checkpoint goes to ``directory/iter_XXXXXXX``.
        model: a model chunk or Megatron's list of chunks (wrapped or not).
        optimizer: a Megatron optimizer (``get_optimizer``), or None for weights only.
        data_state: the caller's data position (JSON-serialisable), handed back by
            :func:`load_checkpoint`.
        fingerprint: JSON-serialisable facts that must match on load (model shape,
            vocabulary, ...); a mismatch is refused with the differing fields named.
        before_commit: called on every rank with the temporary directory once every
            shard is written, before the checkpoint becomes visible (fault-injection
            tests use it).

    Returns:
        The iteration directory.

    Raises:
        ValueError: a negative ``iteration`` or a non-Megatron optimizer.
    """
    if iteration < 0:
        raise ValueError(f"iteration: must be >= 0, got {iteration}")
    _check_optimizer(optimizer)
    _need_psutil("save_checkpoint")
    chunks = as_chunks(model)
    layout = _layout()
    final = iteration_dir(directory, iteration)
    tmp = make_temp_dir(final) if _rank() == 0 else None  # named after rank 0's process (atomic)
    tmp = _broadcast(tmp)
    _barrier()
    state = _sharded_state(chunks, optimizer, is_loading=False, rng=rng_state(), layout=layout)
    writer = save_sharded(state, tmp)  # ends with a barrier
    if _rank() == 0:
        train_state = {
            "format_version": FORMAT_VERSION,
            "iteration": int(iteration),
            "data_state": data_state or {},
            "layout": layout,
            "fingerprint": fingerprint or {},
            "model_chunks": len(chunks),
            "optimizer": _optimizer_kinds(optimizer),
            "optimizer_sharding": OPTIMIZER_SHARDING["distrib_optim_sharding_type"],
            "writer": writer,
        }
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
            json.dump(train_state, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
    _barrier()
    if before_commit is not None:
        before_commit(tmp)
    if _rank() == 0:
        publish_dir(tmp, final)  # re-saving an iteration moves the old copy aside first
        write_text_atomically(os.path.join(directory, LATEST), f"{iteration}\n")
    _barrier()
    return final


def load_checkpoint(
    directory: str,
    model,
    optimizer: Optional[MegatronOptimizer] = None,
    *,
    fingerprint: Optional[Dict[str, Any]] = None,
    iteration: Optional[int] = None,
) -> LoadedCheckpoint:
    """Load the checkpoint ``DIR/latest`` names (or ``iteration``) into ``model`` and
    ``optimizer``, on any TP/PP/DP layout.

    Collective. Rank 0 first removes stale ``*.tmp-*`` entries of interrupted saves.

    Args:
        directory: the checkpoint root given to :func:`save_checkpoint`.
        model, optimizer: built as for the saving run (any layout); the optimizer may be
            None to load weights only.
        fingerprint: compared with the saved one; every field present in both must match.
        iteration: a specific iteration instead of ``latest``.

    Returns:
        A :class:`LoadedCheckpoint` (iteration, data position, whether RNG was restored).

    Raises:
        FileNotFoundError: no checkpoint there.
        ValueError: a corrupt ``latest``/``train_state.json``, a fingerprint mismatch or a
            non-Megatron optimizer.
    """
    _check_optimizer(optimizer)
    chunks = as_chunks(model)
    found = None
    if _rank() == 0:
        try:
            found = (check_load_dir(directory) if iteration is None else iteration, remove_stale_temp(directory))
        except (OSError, ValueError) as e:
            found = e
    found = _broadcast(found)
    if isinstance(found, BaseException):
        raise found
    step, removed = found
    path = iteration_dir(directory, step)
    saved = read_train_state(path)
    _check_fingerprint(path, saved.get("fingerprint", {}), fingerprint or {})
    kinds, saved_kinds = _optimizer_kinds(optimizer), saved.get("optimizer")
    if optimizer is not None and isinstance(saved_kinds, list) and kinds != saved_kinds:
        raise ValueError(
            f"{path}: holds {'/'.join(saved_kinds) or 'no'} optimizer state, this run has {'/'.join(kinds)}; "
            "build the optimizer as the saving run did (distributed optimizer and bf16 alike) or load weights only"
        )
    if saved.get("model_chunks", 1) != len(chunks):
        raise ValueError(f"{path}: saved with {saved['model_chunks']} model chunks, this run has {len(chunks)} "
                         "(virtual pipeline stages must match)")
    layout = _layout()
    same_layout = saved["layout"] == layout
    rng = rng_state() if same_layout else None  # the template: same structure as the saved object
    state = _sharded_state(chunks, optimizer, is_loading=True, rng=rng, layout=layout)
    loaded = dist_checkpointing.load(state, path)
    for i, chunk in enumerate(chunks):
        unwrap(chunk).load_state_dict(loaded[_chunk_key(i, len(chunks))], strict=True)
    if optimizer is not None:
        with cuda_factories_on_cpu(), adam_step_kept_on_load(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
        unshare_adam_steps(optimizer)
    if same_layout:
        set_rng_state(loaded["rng_state"])
    return LoadedCheckpoint(int(saved["iteration"]), dict(saved.get("data_state") or {}), path, same_layout,
                            dict(saved["layout"]), list(removed))


def _check_fingerprint(path: str, saved: Dict[str, Any], current: Dict[str, Any]) -> None:
    differ = [k for k in sorted(set(saved) & set(current)) if saved[k] != current[k]]
    if differ:
        detail = ", ".join(f"{k}: checkpoint {saved[k]!r} vs this run {current[k]!r}" for k in differ)
        raise ValueError(f"{path}: saved with different settings ({detail}); use the saving run's settings")
