"""HF directory <-> Megatron distributed checkpoint (``megatron.core.dist_checkpointing``).

``import_hf`` writes a dist checkpoint plus ``model_args.json`` (the HF config and dtype,
enough to rebuild the GPTModel); TP/PP sharding is chosen when loading
(:func:`load_megatron`). ``export_hf`` writes ``config.json`` + safetensors that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. Run them single-process (the
tools do).

Failing cleanly, losing nothing: inputs (``config.json``, the safetensors headers, the
Megatron checkpoint's files) and the target are checked before the model is built or a
weight is read, and bad input raises ``ValueError``/``OSError`` with one line naming the
file (a tensor's file for a missing or misshapen tensor). Both write into a temporary
directory renamed at the end (:func:`megatron_branch.atomic.atomic_dir`); leftovers of a
killed run are removed by the next one. The distributed checkpoint is written by this
process (:func:`megatron_branch.training.checkpoint.save_sharded`), so a killed
conversion leaves no writer process behind.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Dict, Optional

import torch

from megatron_branch.atomic import atomic_dir
from megatron_branch.hf.io import check_config, check_target, read_config, read_weights, write_weights
from megatron_branch.hf.mapping import (
    TensorError,
    architecture,
    check_params_dtype,
    hf_to_megatron,
    megatron_args_from_hf,
)

ARGS_FILE = "model_args.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Test hook, after an import has written the distributed checkpoint into its temporary
# directory, before the rename: "pause-after-write" waits there (tests kill it),
# "raise-after-write" raises a RuntimeError (an unexpected failure: exit code 1).
FAULT_ENV = "MEGATRON_BRANCH_CONVERT_FAULT"
FAULTS = ("pause-after-write", "raise-after-write")


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype: {name!r} is not one of {tuple(DTYPES)}")
    return DTYPES[name]


def _fault_point(tmp: str) -> None:
    kind = os.environ.get(FAULT_ENV)
    if not kind:
        return
    if kind not in FAULTS:
        raise ValueError(f"{FAULT_ENV}={kind!r}: expected one of {', '.join(FAULTS)}")
    if kind == "raise-after-write":
        raise RuntimeError(f"injected failure after writing {tmp} ({FAULT_ENV})")
    print(f"{FAULT_ENV}: paused after writing {tmp}", file=sys.stderr, flush=True)
    while True:
        time.sleep(60)


def _mapped(weights, hf_cfg: dict, hf_dir: str, sources: Dict[str, str]):
    try:
        return hf_to_megatron(weights, hf_cfg)
    except ValueError as e:
        text = str(e)
        text = text[len("checkpoint: "):] if text.startswith("checkpoint: ") else text
        if isinstance(e, TensorError) and e.tensor in sources:
            raise ValueError(f"{sources[e.tensor]}: {text}") from None
        raise ValueError(f"--hf-model {hf_dir}: {text}; the checkpoint does not match its config.json "
                         "(a shard missing from the download?)") from None


def import_hf(hf_dir: str, megatron_path: str, dtype: str = "fp32", overwrite: bool = False,
              progress: Optional[Callable[[str], None]] = None, _fail_after_save: bool = False,
              report: Optional[Callable[[str], None]] = None) -> None:
    """Convert a HF checkpoint directory into a Megatron distributed checkpoint.

    ``progress`` receives the phases; ``report`` the clean-up of a killed run's leftovers
    (:func:`megatron_branch.hf.io.check_target`; default: printed to stderr).

    Raises:
        ValueError: unsupported architecture, missing config fields, missing/unexpected
            tensors, a shape mismatch, a corrupt safetensors file, bad dtype or an
            existing non-empty target (without ``overwrite``).
        OSError: a missing input, or a target that cannot be written.
    """
    # heavy (megatron-core): imported once the inputs are checked, so bad input fails in a second
    from megatron_branch.hf.model import build_from_hf_config, cast_weights, load_state
    from megatron_branch.training.checkpoint import save_sharded

    note = progress or (lambda _msg: None)
    torch_dtype = _dtype(dtype)
    hf_cfg = read_config(hf_dir)
    check_params_dtype(hf_cfg, torch_dtype)
    check_target(megatron_path, overwrite, "--megatron-path", report)
    note("reading safetensors")
    sources: Dict[str, str] = {}
    state = _mapped(read_weights(hf_dir, sources), hf_cfg, hf_dir, sources)
    note(f"mapping {len(state)} tensors")
    model, _ = build_from_hf_config(hf_cfg, torch_dtype)
    load_state(model, cast_weights(state, torch_dtype))
    with atomic_dir(megatron_path, overwrite) as tmp:
        note("writing the distributed checkpoint")
        writer = save_sharded(model.sharded_state_dict(), tmp)
        _fault_point(tmp)
        if _fail_after_save:  # lets tests interrupt a conversion mid-write
            raise RuntimeError("simulated failure during conversion")
        with open(os.path.join(tmp, ARGS_FILE), "w") as f:
            json.dump({"hf_config": hf_cfg, "dtype": dtype, "writer": writer}, f, indent=2)


def check_megatron_checkpoint(megatron_path: str, flag: str = "--megatron-path") -> dict:
    """Check before any heavy work that ``megatron_path`` is a checkpoint written by
    :func:`import_hf`; returns its ``model_args.json``.

    Raises:
        FileNotFoundError: no such directory, or no ``model_args.json`` in it.
        ValueError: a corrupt ``model_args.json`` or an incomplete checkpoint.
    """
    if not os.path.isdir(megatron_path):
        raise FileNotFoundError(f"{flag} {megatron_path}: no such directory; pass a directory written by "
                                "`convert_checkpoint.py import`")
    path = os.path.join(megatron_path, ARGS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {megatron_path}: has no {ARGS_FILE}; not a checkpoint written by "
                                "`convert_checkpoint.py import` (run the import again)")
    try:
        with open(path) as f:
            args = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt ({e}); run the import again") from None
    if not isinstance(args, dict) or not isinstance(args.get("hf_config"), dict) or args.get("dtype") not in DTYPES:
        raise ValueError(f"{path}: lacks hf_config or a dtype in {tuple(DTYPES)}; run the import again")
    check_config(args["hf_config"], f"{path} (hf_config)")
    if not os.path.isfile(os.path.join(megatron_path, "metadata.json")):
        raise ValueError(f"{flag} {megatron_path}: has no metadata.json; the distributed checkpoint is "
                         "incomplete, run the import again")
    return args


def load_megatron(megatron_path: str, **spec_kwargs):
    """Build the branch-spec GPTModel of a converted checkpoint and load it, on whatever
    TP/PP layout is initialised. Returns ``(model, hf_config)``.

    Raises:
        FileNotFoundError, ValueError: not a checkpoint of :func:`import_hf`, or one that is
            incomplete or corrupt (the directory named).
    """
    # heavy (megatron-core): imported once the checkpoint is checked
    from megatron_branch._megatron import dist_checkpointing
    from megatron_branch.hf.model import build_from_hf_config

    args = check_megatron_checkpoint(megatron_path)
    model, _ = build_from_hf_config(args["hf_config"], _dtype(args["dtype"]), spec_kwargs or None)
    try:
        state = dist_checkpointing.load(model.sharded_state_dict(), megatron_path)
        model.load_state_dict(state)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, trace)}
        cause = next(iter(failures.values()))[0] if failures else e
        if isinstance(cause, (TimeoutError, ConnectionError, getattr(torch.distributed, "DistError", ()))):
            raise  # a peer or the network, not the files
        text = " ".join(f"{type(cause).__name__}: {cause}".split()).rstrip(":")[:400]
        raise ValueError(f"--megatron-path {megatron_path}: cannot be loaded ({text}); the checkpoint is "
                         "incomplete or corrupt, run the import again") from e
    return model, args["hf_config"]


def _shape_of(hf_cfg: dict) -> dict:
    """The fields of a HF config that decide the weights' names, shapes and layout (Megatron's names)."""
    config, model = megatron_args_from_hf(hf_cfg)
    keys = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
            "add_qkv_bias", "qk_layernorm", "num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq",
            "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_enable_expert_bias",
            # multi-latent attention (DeepSeek-V3)
            "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
            # Gated DeltaNet hybrids (Qwen3-Next): the layer pattern, GDN sizes, gated attention
            "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "attention_output_gate")
    out = {k: config.get(k) for k in keys}
    # the tensors' layout is per architecture (e.g. Qwen3-Next's and Qwen3.5's GDN projections)
    out.update(vocab_size=model["vocab_size"], tied=model["share_embeddings_and_output_weights"],
               architecture=architecture(hf_cfg))
    if config.get("multi_latent_attention"):  # the order of the RoPE rows on export (.deepseek)
        out["rope_interleave"] = bool(hf_cfg.get("rope_interleave", True))
    return out


def export_hf(megatron_path: str, hf_out: str, hf_config_dir: Optional[str] = None, overwrite: bool = False,
              max_shard_bytes: int = 4 << 30, progress: Optional[Callable[[str], None]] = None,
              report: Optional[Callable[[str], None]] = None) -> None:
    """Write a converted checkpoint back as a HF directory (config.json + safetensors);
    ``progress`` and ``report`` as for :func:`import_hf`.

    Raises:
        FileNotFoundError, ValueError: a missing, incomplete or corrupt checkpoint, a bad
            ``--hf-config``, or an existing non-empty target (without ``overwrite``).
        OSError: a target that cannot be written.
    """
    # heavy (megatron-core): imported once the inputs are checked
    from megatron_branch.hf.model import export_hf_state

    note = progress or (lambda _msg: None)
    saved = check_megatron_checkpoint(megatron_path)["hf_config"]
    hf_cfg_override = read_config(hf_config_dir, "--hf-config") if hf_config_dir else None
    if hf_cfg_override is not None:
        mine, theirs = _shape_of(hf_cfg_override), _shape_of(saved)
        differ = [f"{k} {mine.get(k)} vs {theirs.get(k)}" for k in sorted(set(mine) | set(theirs))
                  if mine.get(k) != theirs.get(k)]
        if differ:
            raise ValueError(f"--hf-config {hf_config_dir}: describes another model than --megatron-path "
                             f"{megatron_path} ({', '.join(differ)}); pass the config it was imported from")
    check_target(hf_out, overwrite, "--hf-model", report)
    note("loading the distributed checkpoint")
    model, hf_cfg = load_megatron(megatron_path)
    hf_cfg = hf_cfg_override or hf_cfg
    state = export_hf_state(model, hf_cfg)
    with atomic_dir(hf_out, overwrite) as tmp:
        note(f"writing {len(state)} tensors")
        write_weights(tmp, state, max_shard_bytes)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2)
