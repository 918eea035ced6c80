"""HF directory <-> Megatron distributed checkpoint (``megatron.core.dist_checkpointing``).

``import_hf`` writes a dist checkpoint plus ``model_args.json`` (the HF config and dtype,
enough to rebuild the GPTModel); TP/PP sharding is chosen when loading
(:func:`load_megatron`). ``export_hf`` writes ``config.json`` + safetensors that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. Both write into a temporary
directory renamed at the end. Run them single-process (the tools do).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch

from megatron_branch.hf import build_from_hf_config, export_hf_state, load_state
from megatron_branch.hf.io import atomic_dir, read_config, read_weights, write_weights
from megatron_branch.hf.mapping import hf_to_megatron

ARGS_FILE = "model_args.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype: {name!r} is not one of {tuple(DTYPES)}")
    return DTYPES[name]


def import_hf(hf_dir: str, megatron_path: str, dtype: str = "fp32", overwrite: bool = False,
              progress: Optional[Callable[[str], None]] = None, _fail_after_save: bool = False) -> None:
    """Convert a HF checkpoint directory into a Megatron distributed checkpoint.

    Raises:
        ValueError: unsupported architecture, missing/unexpected tensors, shape mismatch,
            bad dtype or an existing non-empty target (without ``overwrite``).
    """
    from megatron.core import dist_checkpointing

    note = progress or (lambda _msg: None)
    torch_dtype = _dtype(dtype)
    hf_cfg = read_config(hf_dir)
    note("reading safetensors")
    state = hf_to_megatron(read_weights(hf_dir), hf_cfg)
    note(f"mapping {len(state)} tensors")
    model, _ = build_from_hf_config(hf_cfg, torch_dtype)
    load_state(model, {k: v.to(torch_dtype) for k, v in state.items()})
    with atomic_dir(megatron_path, overwrite) as tmp:
        note("writing the distributed checkpoint")
        dist_checkpointing.save(model.sharded_state_dict(), tmp)
        if _fail_after_save:  # lets tests interrupt a conversion mid-write
            raise RuntimeError("simulated failure during conversion")
        with open(os.path.join(tmp, ARGS_FILE), "w") as f:
            json.dump({"hf_config": hf_cfg, "dtype": dtype}, f, indent=2)


def load_megatron(megatron_path: str, **spec_kwargs):
    """Build the branch-spec GPTModel of a converted checkpoint and load it, on whatever
    TP/PP layout is initialised. Returns ``(model, hf_config)``."""
    from megatron.core import dist_checkpointing

    args_path = os.path.join(megatron_path, ARGS_FILE)
    if not os.path.isfile(args_path):
        raise ValueError(f"--megatron-path: {megatron_path} has no {ARGS_FILE} (not made by import?)")
    with open(args_path) as f:
        args = json.load(f)
    model, _ = build_from_hf_config(args["hf_config"], _dtype(args["dtype"]), spec_kwargs or None)
    state = dist_checkpointing.load(model.sharded_state_dict(), megatron_path)
    model.load_state_dict(state)
    return model, args["hf_config"]


def export_hf(megatron_path: str, hf_out: str, hf_config_dir: Optional[str] = None, overwrite: bool = False,
              max_shard_bytes: int = 4 << 30, progress: Optional[Callable[[str], None]] = None) -> None:
    """Write a converted checkpoint back as a HF directory (config.json + safetensors)."""
    note = progress or (lambda _msg: None)
    note("loading the distributed checkpoint")
    model, hf_cfg = load_megatron(megatron_path)
    if hf_config_dir:
        hf_cfg = read_config(hf_config_dir)
    state = export_hf_state(model, hf_cfg)
    with atomic_dir(hf_out, overwrite) as tmp:
        note(f"writing {len(state)} tensors")
        write_weights(tmp, state, max_shard_bytes)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2)
