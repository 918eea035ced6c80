"""Writing outputs so that nothing is lost: one temp-name convention, atomic publish, checks.

Every output the package writes (training checkpoints, converted checkpoints) is first
written under a temporary name next to its target and renamed at the end, so a failure
never leaves a half-written result under the target name. The temporary name records
its writer::

    .NAME.tmp-<pid>-<start>-<host>-<random>     a partial output
    .NAME.old-<pid>-<start>-<host>-<random>     a previous NAME moved aside while it is replaced

so a later run can tell a leftover of a killed run (its process gone; pid reuse told
apart by the start time) from the work of a writer still running
(:func:`remove_stale_temps`), and put back a previous target that a killed replacement
had moved aside. Temporary entries of other hosts (a shared file system) are never
touched: their process cannot be checked.

Also here: the checks that an output target can be written at all, run before any
heavy work (:func:`check_output_file`, :func:`check_output_dir`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import sys
import tempfile
from typing import Callable, Iterator, List, Optional, Tuple

_OWNED = re.compile(r"^\.(?P<base>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-(?P<start>\d+)-(?P<host>[0-9a-f]{8})-[a-z0-9_]+$")


# ------------------------------------------------------------------------ target checks
def check_output_file(flag: str, path: str) -> None:
    """An output file can be written: not a directory, its directory exists and is writable."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise PermissionError(f"{flag} {path}: not writable; choose a writable location")


def check_output_dir(flag: str, path: str) -> None:
    """An output directory can be created or written: not a file, writable."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a file, not a directory; choose a directory")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{flag} {path}: {probe} is a file; choose a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(f"{flag} {path}: {probe} is not writable; choose a writable directory")


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (a rename into it) to disk; best effort, as not every
    file system lets a directory be opened or synced."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------ temp names
def host_tag() -> str:
    """Eight hex digits naming this host in temporary names."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _process_start() -> int:
    import psutil  # required dependency; imported here so path checks need no psutil

    return int(psutil.Process().create_time())


def temp_prefix(target: str, kind: str = "tmp") -> str:
    """``.NAME.<kind>-<pid>-<start>-<host>-`` for ``target`` written by this process."""
    if kind not in ("tmp", "old"):
        raise ValueError(f"kind: {kind!r} is not 'tmp' or 'old'")
    return f".{os.path.basename(os.path.abspath(target))}.{kind}-{os.getpid()}-{_process_start()}-{host_tag()}-"


def make_temp_dir(target: str, kind: str = "tmp") -> str:
    """A new empty directory next to ``target`` under this process's temporary name."""
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=temp_prefix(target, kind), dir=parent)


def _owner_gone(pid: int, start: int) -> bool:
    """The process that made a temporary entry has exited (pid reuse is told apart by
    the start time; a zombie counts as gone)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - start) > 2:
            return True
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # e.g. access denied: it exists
        return False


def stale_temps(directory: str, base: Optional[str] = None, *, own_process: bool = False) -> List[Tuple[str, str, int]]:
    """``(path, kind, pid)`` of the temporary entries in ``directory`` whose writer is gone.

    Args:
        directory: where to look.
        base: only entries for this target name (``None``: any).
        own_process: also this process's own entries (right when the caller knows none
            of its writes is running, e.g. a checkpoint load).

    Entries of other hosts or of live processes, and anything not named by this
    module's convention, are not listed.
    """
    if not os.path.isdir(directory):
        return []
    found = []
    for name in sorted(os.listdir(directory)):
        m = _OWNED.match(name)
        path = os.path.join(directory, name)
        if not m or (base is not None and m["base"] != base) or m["host"] != host_tag() or os.path.islink(path):
            continue
        pid, start = int(m["pid"]), int(m["start"])
        mine = own_process and pid == os.getpid() and abs(start - _process_start()) <= 2
        if mine or _owner_gone(pid, start):
            found.append((path, m["kind"], pid))
    return found


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


def clean_stale_temps(stale: List[Tuple[str, str, int]], *, what: str = "write", replacement: str = "replacement",
                      report: Optional[Callable[[str], None]] = None) -> List[str]:
    """Clean up the entries :func:`stale_temps` found: put back a previous target that a
    killed replacement had moved aside (when the target is missing), and remove partial
    outputs. Each action is one line, passed to ``report`` (default: printed to stderr)
    as it happens, and returned.

    Args:
        stale: from :func:`stale_temps`.
        what: the interrupted work, for the lines (``"conversion"``, ``"save"``).
        replacement: what moves a previous target aside, for the lines (``"--overwrite"``).
    """
    done: List[str] = []
    for path, kind, pid in stale:
        target = os.path.join(os.path.dirname(path), _OWNED.match(os.path.basename(path))["base"])
        why = "this process" if pid == os.getpid() else f"process {pid} is gone"
        if kind == "old" and not os.path.exists(target):
            os.rename(path, target)
            done.append(f"restored {target} from {path}, moved aside by an interrupted {replacement} ({why})")
        else:
            _remove(path)
            item = "partial output" if kind == "tmp" else "replaced copy"
            done.append(f"removed {path}, the {item} of an interrupted {what} ({why})")
        (report or _to_stderr)(done[-1])
    return done


def remove_stale_temps(directory: str, base: Optional[str] = None, *, own_process: bool = False,
                       **clean) -> List[str]:
    """:func:`clean_stale_temps` of :func:`stale_temps` ``(directory, base, own_process=...)``."""
    return clean_stale_temps(stale_temps(directory, base, own_process=own_process), **clean)


# ------------------------------------------------------------------------ publish
def publish_dir(tmp: str, target: str) -> None:
    """Rename the finished directory ``tmp`` to ``target``, durably. An existing
    ``target`` is moved aside under an ``old`` name first and deleted after the rename
    (a kill in between leaves it to be put back by :func:`remove_stale_temps`)."""
    parent = os.path.dirname(os.path.abspath(target))
    fsync_dir(tmp)
    if os.path.exists(target):
        old = make_temp_dir(target, "old")
        os.rename(target, old)  # replaces the empty placeholder
        os.rename(tmp, target)
        fsync_dir(parent)
        shutil.rmtree(old)
    else:
        os.rename(tmp, target)
        fsync_dir(parent)


@contextlib.contextmanager
def atomic_dir(target: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary directory that becomes ``target`` only if the block succeeds.

    Raises:
        ValueError: ``target`` exists and is not empty, unless ``overwrite``.
    """
    if os.path.exists(target) and os.listdir(target) and not overwrite:
        raise ValueError(f"{target}: exists and is not empty (pass --overwrite to replace it)")
    tmp = make_temp_dir(target, "tmp")
    try:
        yield tmp
        publish_dir(tmp, target)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)


def write_text_atomically(path: str, text: str) -> None:
    """Replace the file ``path`` with ``text`` in one rename (written and synced under a
    temporary name first)."""
    parent = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path, "tmp"), dir=parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(parent)
