"""Reading and writing Hugging Face checkpoint directories: safetensors only, atomic.

Weights are never unpickled: ``*.safetensors`` (single or sharded with
``model.safetensors.index.json``). Bad input raises ``ValueError``/``OSError`` with one
line naming the file and what to do (the converter reports it with exit code 2):
a missing or invalid ``config.json`` (missing fields, unsupported architecture), a
truncated or corrupt safetensors file, a corrupt index or a shard it names that is
missing.

Output directories are written atomically with the package's one convention
(:mod:`megatron_branch.atomic`): under ``.NAME.tmp-<pid>-<start>-<host>-<random>`` next to
the target, renamed at the end, so a failure never leaves a half-written checkpoint under
the target name; :func:`check_target` first removes the leftovers of killed conversions
(their process gone) and puts back a target that a killed ``--overwrite`` had moved aside.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable, Dict, List, Optional

from torch import Tensor

from megatron_branch.atomic import check_output_dir, remove_stale_temps
from megatron_branch.hf.mapping import megatron_args_from_hf

INDEX = "model.safetensors.index.json"


def check_input_json(flag: str, path: str, expected: str = "a Hugging Face config.json") -> None:
    """An input JSON file exists, is readable and holds an object (``expected`` names what)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file")
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: not valid JSON ({e}); pass {expected}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag} {path}: holds a JSON {type(data).__name__}, expected an object ({expected})")


# ------------------------------------------------------------------------------ input
def read_config(hf_dir: str, flag: str = "--hf-model") -> dict:
    """``hf_dir/config.json``, checked: valid JSON, a supported architecture, every size
    field the conversion reads.

    Raises:
        FileNotFoundError: ``hf_dir`` is not a directory.
        ValueError: no ``config.json``, or an invalid or unsupported one (named).
    """
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"{flag} {hf_dir}: no such directory; pass a Hugging Face model directory "
                                "(config.json + *.safetensors)")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {hf_dir}: has no config.json; pass a Hugging Face model directory "
                         "(config.json + *.safetensors)")
    check_input_json(flag, path)
    with open(path) as f:
        cfg = json.load(f)
    check_config(cfg, path)
    return cfg


def check_config(cfg: dict, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` if ``cfg`` cannot be converted."""
    try:
        megatron_args_from_hf(cfg)
    except ValueError as e:
        text = str(e)
        text = text[len("config.json: "):] if text.startswith("config.json: ") else text
        raise ValueError(f"{where}: {text}") from None


def weight_files(hf_dir: str, flag: str = "--hf-model") -> List[str]:
    """Paths of the ``*.safetensors`` files of ``hf_dir`` (from the index when there is one).

    Raises:
        ValueError: none (pickle checkpoints are named and refused), or a corrupt index.
        FileNotFoundError: a shard the index names is missing.
    """
    index = os.path.join(hf_dir, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: corrupt ({type(e).__name__}: {e}); download the checkpoint again") from None
        for name in files:
            if not os.path.isfile(os.path.join(hf_dir, name)):
                raise FileNotFoundError(f"{os.path.join(hf_dir, name)}: missing (listed in {INDEX}); "
                                        "download the checkpoint again")
    else:
        files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        pickled = [f for f in os.listdir(hf_dir) if f.endswith((".bin", ".pt", ".pth"))]
        hint = f" (found {pickled[0]}: pickle checkpoints are not loaded; re-save with safetensors)" if pickled else ""
        raise ValueError(f"{flag} {hf_dir}: has no *.safetensors weights{hint}")
    return [os.path.join(hf_dir, name) for name in files]


def _corrupt(path: str, exc: Exception) -> ValueError:
    text = " ".join(str(exc).split())
    return ValueError(f"{path}: not a readable safetensors file ({text}); it is truncated or corrupt, "
                      "download or copy it again")


def check_weights(hf_dir: str, flag: str = "--hf-model") -> Dict[str, str]:
    """Open every safetensors file's header (cheap: no tensor is read), so a truncated or
    corrupt file is reported before any heavy work. Returns ``tensor name -> file``."""
    from safetensors import SafetensorError, safe_open

    where: Dict[str, str] = {}
    for path in weight_files(hf_dir, flag):
        try:
            with safe_open(path, framework="pt") as f:
                where.update({name: path for name in f.keys()})
        except (SafetensorError, OSError) as e:
            raise _corrupt(path, e) from None
    return where


def read_weights(hf_dir: str, sources: Optional[Dict[str, str]] = None) -> Dict[str, Tensor]:
    """All tensors of a HF directory (safetensors only); ``sources`` (if given) receives
    ``tensor name -> file``.

    Raises:
        ValueError: a truncated or corrupt file (named), or no safetensors weights.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: Dict[str, Tensor] = {}
    for path in weight_files(hf_dir):
        try:
            part = load_file(path)
        except (SafetensorError, OSError) as e:
            raise _corrupt(path, e) from None
        state.update(part)
        if sources is not None:
            sources.update({name: path for name in part})
    return state


# ----------------------------------------------------------------------------- output
def check_target(target: str, overwrite: bool, flag: str, report: Optional[Callable[[str], None]] = None) -> List[str]:
    """Check before any heavy work that ``target`` (an output directory) can be written,
    after cleaning up stale temporary directories of killed runs.

    Returns:
        The clean-up lines of :func:`megatron_branch.atomic.remove_stale_temps` (each also passed to
        ``report`` as it happens; default: printed to stderr).

    Raises:
        ValueError: ``target`` is a file, or a non-empty directory without ``overwrite``.
        OSError: its directory cannot be written.
    """
    check_output_dir(flag, target)  # a file; an unwritable existing ancestor
    probe = os.path.abspath(target)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:  # os.access says yes to root on a directory that refuses entries (e.g. /proc)
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=probe))
    except OSError as e:
        raise PermissionError(f"{flag} {target}: cannot write in {probe} ({e.strerror}); choose a writable "
                              "directory") from None
    done = remove_stale_temps(os.path.dirname(os.path.abspath(target)), os.path.basename(os.path.abspath(target)),
                              what="conversion", replacement="--overwrite", report=report)
    if os.path.isdir(target) and os.listdir(target) and not overwrite:
        raise ValueError(f"{flag} {target}: exists and is not empty; pass --overwrite to replace it or choose "
                         "another directory")
    return done


def write_weights(out_dir: str, state: Dict[str, Tensor], max_shard_bytes: int = 4 << 30) -> None:
    """Write ``state`` as safetensors, sharded with an index above ``max_shard_bytes``."""
    from safetensors.torch import save_file

    shards, current, size = [], {}, 0
    for name in sorted(state):
        t = state[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
