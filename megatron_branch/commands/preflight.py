"""Checks of command-line inputs and output targets, run before any heavy work.

Shared by ``megatron-branch`` (:mod:`megatron_branch.cli`) and the checkpoint converter
(``tools/convert_checkpoint.py``): each raises ``ValueError``/``OSError`` with one line
naming the flag and the path and saying what to do, which
:func:`megatron_branch.distributed.run_main` reports with exit code 2. No torch import.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import warnings


def quiet_megatron_warnings() -> None:
    """Silence megatron-core's import-time warnings about the Apex/Transformer Engine
    fallbacks (expected on CPU), so a failure stays one line. Call before importing it."""
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", module="megatron.core.transformer.transformer_config")


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def check_input_json(flag: str, path: str) -> None:
    """An input JSON file exists, is readable and holds an object."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file")
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: not valid JSON ({e}); pass a Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag} {path}: holds a JSON {type(data).__name__}, expected an object (config.json)")


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (a rename into it) to disk; best effort, as not every
    file system lets a directory be opened or synced."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
