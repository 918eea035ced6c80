"""Convert checkpoints between Hugging Face and Megatron (distributed checkpoint).

    python tools/convert_checkpoint.py import --hf-model HF_DIR --megatron-path OUT [--dtype bf16]
    python tools/convert_checkpoint.py export --megatron-path DIR --hf-model OUT [--hf-config HF_DIR]

Architectures: Llama (incl. Llama-3 RoPE scaling), Mistral, Qwen2 (QKV bias), Qwen3
(q/k norm), and Mixture of Experts: Qwen3-MoE, Mixtral, GLM-4.5 and, with megatron-core 0.19,
DeepSeek-V3, Qwen3-Next and Qwen3.5 (dense and MoE; the released multimodal checkpoints as their
text model) (Megatron's MoE layer with sequential experts; expert-parallel sharding is chosen at
load time too; docs/model_families.md); tied or untied embeddings; GQA. Safetensors only (no
pickle). TP/PP sharding is chosen when a run loads the checkpoint
(``megatron_branch.hf.convert.load_megatron``). Runs on CPU.

Failures: the inputs (config.json, every safetensors header, the Megatron checkpoint's
files) and the target (not a file, empty unless --overwrite, writable) are checked before
any heavy work; bad input is one line naming the file or flag and what to do, exit code
2; any other failure one line, exit code 1; --debug (or MEGATRON_BRANCH_DEBUG=1) adds the
traceback. The output is written to a temporary directory next to the target
(.NAME.tmp-<pid>-...) and renamed at the end; a run killed meanwhile leaves the target
untouched and no process behind (the distributed checkpoint is written in process), and
the next run removes its temporary directory (and says so). SIGTERM and Ctrl-C remove it
at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)

from megatron_branch.commands.preflight import OneLineParser, quiet_megatron_warnings  # noqa: E402

PROG = "convert_checkpoint"
COMMANDS = ("import", "export")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{import,export}")
    imp = sub.add_parser("import", help="HF directory -> Megatron distributed checkpoint")
    imp.add_argument("--hf-model", required=True, help="HF directory (config.json + *.safetensors)")
    imp.add_argument("--megatron-path", required=True, help="output directory")
    imp.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    imp.add_argument("--tp", type=int, default=1, help="accepted for compatibility: sharding is chosen at load time")
    imp.add_argument("--pp", type=int, default=1, help="accepted for compatibility: sharding is chosen at load time")
    imp.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    exp = sub.add_parser("export", help="Megatron distributed checkpoint -> HF directory")
    exp.add_argument("--megatron-path", required=True, help="a directory written by import")
    exp.add_argument("--hf-model", required=True, help="output HF directory")
    exp.add_argument("--hf-config", default=None, help="take config.json from this HF directory instead")
    exp.add_argument("--max-shard-gb", type=float, default=4.0, help="safetensors shard size")
    exp.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    for p in (imp, exp):
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="print the traceback of a failure")
    return parser


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _report(line: str) -> None:
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def preflight(args) -> None:
    """The cheap checks, before torch.distributed, the model or any weight: inputs, then the
    target (stale temporary directories of killed runs are removed, one line each).
    Raises ValueError/OSError naming the file or flag."""
    from megatron_branch.hf.convert import check_megatron_checkpoint
    from megatron_branch.hf.io import check_target, check_weights, read_config

    if args.command == "import":
        for flag in ("tp", "pp"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag}: must be >= 1, got {getattr(args, flag)}")
        read_config(args.hf_model)
        check_weights(args.hf_model)
        if os.path.exists(args.megatron_path) and _same_dir(args.hf_model, args.megatron_path):
            raise ValueError(f"--megatron-path {args.megatron_path}: is the --hf-model directory; choose another")
        check_target(args.megatron_path, args.overwrite, "--megatron-path", _report)
        return
    if not args.max_shard_gb > 0:
        raise ValueError(f"--max-shard-gb: must be > 0, got {args.max_shard_gb}")
    check_megatron_checkpoint(args.megatron_path)
    if args.hf_config:
        read_config(args.hf_config, "--hf-config")
    for flag, path in (("--megatron-path", args.megatron_path), ("--hf-config", args.hf_config)):
        if path and os.path.exists(args.hf_model) and _same_dir(path, args.hf_model):
            raise ValueError(f"--hf-model {args.hf_model}: is the {flag} directory; choose another")
    check_target(args.hf_model, args.overwrite, "--hf-model", _report)


def _main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    preflight(args)

    warnings.filterwarnings("ignore")
    import megatron_branch as mb
    from megatron_branch.commands.progress import Progress
    from megatron_branch.distributed import init_distributed
    from megatron_branch.hf.convert import export_hf, import_hf

    mb.enable_cpu()
    init_distributed()
    interactive = sys.stderr.isatty()  # a progress bar on a terminal; logs get only the outcome
    with Progress(3, args.command) if interactive else contextlib.nullcontext() as bar:
        note = bar.update if interactive else None
        if args.command == "import":
            import_hf(args.hf_model, args.megatron_path, args.dtype, args.overwrite, note, report=_report)
        else:
            export_hf(args.megatron_path, args.hf_model, args.hf_config, args.overwrite,
                      int(args.max_shard_gb * (1 << 30)), note, report=_report)
    print(f"{args.command}: done -> {args.megatron_path if args.command == 'import' else args.hf_model}")
    return 0


def _stop_on(signum, _frame):
    """SIGTERM/SIGINT: one line, then unwind (the temporary directory is removed on the way)."""
    name = signal.Signals(signum).name
    print(f"\n{PROG}: stopped by {name}; the target is written only by a finished conversion "
          "(the partial output is removed)", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    quiet_megatron_warnings()
    from megatron_branch.distributed import run_main

    args = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in args if a in COMMANDS), None)
    previous = {s: signal.signal(s, _stop_on) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run_main(_main, argv, prog=f"{PROG} {command}" if command else PROG)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
