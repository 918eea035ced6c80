"""Reading and writing Hugging Face checkpoint directories: safetensors only, atomic.

Weights are never unpickled: ``*.safetensors`` (single or sharded with
``model.safetensors.index.json``). Output directories are written under a temporary name
next to the target and renamed at the end, so a failure never leaves a half-written
checkpoint under the target name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Dict, Iterator

from torch import Tensor

INDEX = "model.safetensors.index.json"


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--hf-model: {hf_dir} has no config.json")
    with open(path) as f:
        return json.load(f)


def read_weights(hf_dir: str) -> Dict[str, Tensor]:
    """All tensors of a HF directory (safetensors only)."""
    from safetensors.torch import load_file

    index = os.path.join(hf_dir, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        pickled = [f for f in os.listdir(hf_dir) if f.endswith((".bin", ".pt", ".pth"))]
        hint = f" (found {pickled[0]}: pickle checkpoints are not loaded; re-save with safetensors)" if pickled else ""
        raise ValueError(f"--hf-model: {hf_dir} has no *.safetensors weights{hint}")
    state: Dict[str, Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(hf_dir, name)))
    return state


@contextlib.contextmanager
def atomic_dir(target: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary directory that becomes ``target`` only if the block succeeds.

    Raises:
        ValueError: ``target`` exists and is not empty, unless ``overwrite``.
    """
    if os.path.exists(target) and os.listdir(target) and not overwrite:
        raise ValueError(f"{target}: exists and is not empty (pass --overwrite to replace it)")
    parent = os.path.dirname(os.path.abspath(target)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
    try:
        yield tmp
        if os.path.exists(target):
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)


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
