"""Process-group set-up for single- and multi-process runs (gloo on CPU, NCCL on GPU), and
clean failure reporting.

No hangs: every process group (the default one and Megatron's model-parallel groups)
gets a timeout — ``timeout`` seconds, else ``$MEGATRON_BRANCH_TIMEOUT``, else
:data:`DEFAULT_TIMEOUT_S` — so a collective whose peer is stuck raises instead of waiting
forever. :func:`run_main` turns an exception into one line naming the rank (and, on the
other ranks, the rank that failed first, read from the rendezvous store) and a nonzero
exit code; a launcher such as torchrun then stops the remaining ranks.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import traceback
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron_branch._megatron import parallel_state
from megatron_branch.layout import ParallelLayout, check_sizes

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "MEGATRON_BRANCH_TIMEOUT"
DEBUG_ENV = "MEGATRON_BRANCH_DEBUG"
FAILURE_KEY = "megatron_branch/first_failure"
HEARTBEAT_KEY = "megatron_branch/heartbeat/{}"
# Exceptions that mean "bad input or environment" (exit code 2): bad values, missing or
# unwritable files, a missing optional package. Anything else (and a timeout or a lost
# connection, which are OSErrors too) is a failure of the run (exit 1).
USER_ERRORS = (ValueError, OSError, ImportError)


def is_user_error(exc: BaseException) -> bool:
    """Bad flags, missing/corrupt files, unwritable targets: exit code 2."""
    return isinstance(exc, USER_ERRORS) and not isinstance(exc, (TimeoutError, ConnectionError))


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_timeout() -> float:
    """Collective timeout in seconds: ``$MEGATRON_BRANCH_TIMEOUT`` or 600.

    Long enough for a slow checkpoint save or a first-iteration warm-up, short enough
    that a stuck peer is reported within minutes rather than Megatron's 30.

    Raises:
        ValueError: the variable is not a positive number.
    """
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: must be a positive number of seconds")
    return value


def choose_cuda_device(local_rank: Optional[int], visible: int, current: Optional[int]) -> int:
    """The CUDA device index this process should use.

    Args:
        local_rank: torchrun's ``LOCAL_RANK`` (``None`` when not launched by it).
        visible: ``torch.cuda.device_count()``.
        current: a device the process already selected (``torch.cuda.set_device``), or
            ``None`` when it has not chosen (device 0 by default).

    Raises:
        ValueError: ``LOCAL_RANK`` beyond the visible devices, or a pre-set device that
            disagrees with it.
    """
    if visible < 1:
        raise ValueError("CUDA: no visible device (CUDA_VISIBLE_DEVICES); use backend='gloo' on the CPU")
    if local_rank is None:
        return current if current is not None else 0
    if not 0 <= local_rank < visible:
        raise ValueError(f"LOCAL_RANK={local_rank}: only {visible} CUDA device(s) are visible to this process "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); launch at most "
                         f"{visible} processes per node, or give each its own devices")
    if current is not None and current != local_rank:
        raise ValueError(f"LOCAL_RANK={local_rank}: this process already selected cuda:{current} "
                         f"(torch.cuda.set_device); every rank would not get its own GPU. Select cuda:{local_rank} "
                         "or leave the choice to init_distributed")
    return local_rank


def _local_rank() -> Optional[int]:
    text = os.environ.get("LOCAL_RANK")
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={text!r}: not an integer (set by torchrun)") from None


def select_device() -> torch.device:
    """Select and return this process's device: ``cuda:LOCAL_RANK`` under torchrun with
    CUDA (:func:`choose_cuda_device`; one already chosen by the process is respected when it
    agrees), the current CUDA device without torchrun, the CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    current = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    if current == 0 and _local_rank() not in (None, 0):
        current = None  # device 0 is CUDA's default, not a choice
    index = choose_cuda_device(_local_rank(), torch.cuda.device_count(), current)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    backend: str | None = None,
    timeout: float | None = None,
) -> None:
    """Initialise ``torch.distributed`` (from torchrun's env, or a 1-process group) and
    Megatron's ``parallel_state``. Idempotent for the same sizes.

    Args:
        tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size:
            Megatron's parallel sizes.
        backend: ``"gloo"``/``"nccl"`` (default: NCCL with CUDA, else gloo).
        timeout: seconds a collective may wait for its peers before raising, for the
            default group and every Megatron group (default: :func:`default_timeout`).
            Applies when the groups are created.

    Every rank selects its own device first (:func:`select_device`: ``cuda:LOCAL_RANK``
    under torchrun), so that NCCL and ``model.cuda()`` do not crowd device 0.

    Raises:
        ValueError: the parallel sizes do not divide the world size, a bad timeout, or a
            ``LOCAL_RANK`` without a device of its own.
    """
    seconds = default_timeout() if timeout is None else float(timeout)
    if not seconds > 0:
        raise ValueError(f"timeout: must be a positive number of seconds, got {timeout}")
    delta = datetime.timedelta(seconds=seconds)
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl" or torch.cuda.is_available():
            select_device()
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=delta)
        else:  # one process: an in-memory store, no port to collide on
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=delta)
    check_sizes(dist.get_world_size(), tensor_model_parallel_size, pipeline_model_parallel_size,
                context_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        now = ParallelLayout.current()
        if (now.tp, now.pp, now.cp) == (tensor_model_parallel_size, pipeline_model_parallel_size,
                                        context_parallel_size):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        distributed_timeout_minutes=seconds / 60.0,  # timedelta(minutes=...) takes fractions
    )


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------- failure reports
def _rank() -> Optional[int]:
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None


def _world() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else 1


def _store():
    """The default group's store (torchrun's agent store survives a dead worker)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=5))  # never block a failing process for long
        return store
    except Exception:  # noqa: BLE001 - reporting must not raise
        return None


def _first_failure(store) -> Optional[str]:
    """What the first rank to fail recorded, or None."""
    if store is None:
        return None
    try:
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode(errors="replace")
    except Exception:  # noqa: BLE001 - the store may be gone with the failed rank
        return None
    return None


_BEATS = {"count": 0}


def heartbeat(label: str) -> None:
    """Record in the rendezvous store where this rank is (``"step 3: backward"``).

    One small store write; a no-op on one process. When a collective times out,
    :func:`describe_failure` names the ranks that fell behind the others and where each
    was last seen — the stuck rank, since blocked peers have moved past it.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    _BEATS["count"] += 1
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(HEARTBEAT_KEY.format(dist.get_rank()), f"{_BEATS['count']}|{time.time():.3f}|{label}")
    except Exception:  # noqa: BLE001 - progress reports must never fail a run
        pass


def _laggards(store) -> Optional[str]:
    """``ranks behind: 1 (last at 'step 1: start'; the others reached ...)`` from heartbeats."""
    if store is None:
        return None
    beats = {}
    try:
        for r in range(dist.get_world_size()):
            key = HEARTBEAT_KEY.format(r)
            if store.check([key]):
                count, _, label = store.get(key).decode(errors="replace").split("|", 2)
                beats[r] = (int(count), label)
    except Exception:  # noqa: BLE001
        return None
    if len(beats) < 2:
        return None
    low, high = min(c for c, _ in beats.values()), max(c for c, _ in beats.values())
    if low == high:
        return None
    behind = [r for r, (c, _) in sorted(beats.items()) if c == low]
    ahead = next(label for c, label in beats.values() if c == high)
    last = beats[behind[0]][1]
    return (f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} fell behind "
            f"(last seen at {last!r}; others reached {ahead!r})")


def _record_failure(store, text: str) -> None:
    if store is None:
        return
    try:
        store.compare_set(FAILURE_KEY, "", text)  # only the first failure is kept
    except Exception:  # noqa: BLE001
        pass


def describe_failure(exc: BaseException, prog: Optional[str] = None) -> str:
    """One line for ``exc``: the rank that failed and what happened (``prog: error: ...``
    on a single process).

    On a multi-process run, a rank whose error is a consequence of another rank's
    failure (a closed connection, a timed-out collective) names the rank that failed
    first, as recorded by that rank's :func:`describe_failure`.
    """
    rank, world = _rank(), _world()
    kind = "" if is_user_error(exc) else f"{type(exc).__name__}: "
    text = " ".join(str(exc).split()) or type(exc).__name__
    if len(text) > 600:
        text = text[:600] + " ..."
    if world <= 1 or rank is None:
        return f"{prog + ': ' if prog else ''}error: {kind}{text}"
    store = _store()
    first = _first_failure(store)
    if first is not None and not first.startswith(f"rank {rank} "):
        here = "" if text[:200] in first else f" (here: {kind}{text[:200]})"
        return f"rank {rank} stopped: {first}{here}"
    line = f"rank {rank} failed: {kind}{text}"
    if "timed out" in text.lower() or "timeout" in text.lower():
        behind = _laggards(store)
        line += (f" (a collective waited longer than the timeout: {behind or 'a peer rank is stuck or dead'}; "
                 f"see that rank's log; ${TIMEOUT_ENV} sets the timeout)")
    _record_failure(store, line)
    return line


def run_main(main: Callable[[Optional[List[str]]], int], argv: Optional[List[str]] = None, *,
             debug: Optional[bool] = None, prog: Optional[str] = None) -> int:
    """Run ``main(argv)`` and turn an exception into one line on stderr and an exit code.

    ``ValueError``/``OSError`` (bad flags, missing or corrupt files, unwritable targets)
    exit with 2, anything else with 1; the line names the rank on multi-process runs.
    With ``debug`` (default: ``--debug`` in ``argv``/``sys.argv`` or ``$MEGATRON_BRANCH_DEBUG``)
    the traceback is printed too. ``SystemExit`` and ``KeyboardInterrupt`` pass through.
    ``prog`` starts the line on single-process runs.
    """
    if debug is None:
        args = sys.argv[1:] if argv is None else argv
        debug = "--debug" in args or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return main(argv)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - the one place that reports
        if debug:
            traceback.print_exc()
        line = describe_failure(exc, prog)
        user = is_user_error(exc)
        hint = "" if debug or user else " [--debug shows the traceback]"
        print(line + hint, file=sys.stderr, flush=True)
        return 2 if user else 1
