"""``megatron-branch``: the command-line entry point.

Every command fails cleanly: bad flags, missing or corrupt input files and unwritable
output targets are reported before any heavy work as one line naming the flag or file
and what to do, with exit code 2 (``plan`` exits 1 when the workload does not fit).
Other failures print one line and exit 1. ``--debug`` (before or after the command, or
``$MEGATRON_BRANCH_DEBUG=1``) adds the traceback. The target checks live in
:mod:`megatron_branch.atomic`, shared with ``tools/convert_checkpoint.py``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_branch.atomic import check_output_dir, check_output_file
from megatron_branch.commands.bench.table import report_paths
from megatron_branch.commands.preflight import HelpFormatter, plain_text, quiet_megatron_warnings
from megatron_branch.commands.preflight import OneLineParser as _Parser

# megatron-core warns about Apex/TE fallbacks when imported on CPU; they are expected here
# (so the warnings are silenced before the imports below import it).
quiet_megatron_warnings()

from megatron_branch.distributed import run_main  # noqa: E402
from megatron_branch.hf.io import check_input_json  # noqa: E402

PROG = "megatron-branch"

# (name, module with add_arguments/main and a docstring, one-line help). A command's module
# is imported only when that command runs (or shows its --help): each pulls in its own
# dependencies (megatron-core, matplotlib, transformers), which the others do not need.
COMMANDS = (
    ("demo", "megatron_branch.commands.demo",
     "naive vs branch replay on a small Llama-style model (timing and exactness)"),
    ("bench", "megatron_branch.commands.bench.run",
     "branch replay vs naive and peer methods: time, FLOPs, memory, exactness"),
    ("bench-cp", "megatron_branch.commands.bench.cp",
     "context-parallel replay on CPU processes: balance, time, bytes sent"),
    ("bench-scale", "megatron_branch.commands.bench.scale",
     "the headline workload scaled down: measured per-rank memory vs the planner"),
    ("plan", "megatron_branch.commands.planner.plan",
     "choose TP/CP/PP, chunk, recompute and FP8 for a workload on a cluster"),
    ("study", "megatron_branch.commands.study",
     "convergence and wall-clock of naive, exact and tail-only GRPO/PPO/DPO training"),
    ("verl-check", "megatron_branch.commands.verl_check",
     "which engine verl would build with this environment and config, and why not branch"),
)

# What each command reads and writes, checked before it runs (argument dest, kind).
# "file": an output file (its directory must exist and be writable; not a directory);
# "dir": an output directory (created by the command; must not be a file, and its nearest
# existing ancestor must be writable); "json": an input JSON object file.
OUTPUTS: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "demo": (("json", "file"),),
    "bench": (("out", "dir"),),
    "bench-cp": (("out", "dir"),),
    "bench-scale": (("json", "file"),),
    "plan": (("json", "file"),),
    "study": (("out", "dir"), ("json", "file")),
}
INPUTS: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "plan": (("hf_config", "json"),),
    "bench": (("table", "bench-json"),),
}
# Integer flags that must be >= 1 when given (bench-scale checks its own with its layout).
POSITIVE: Dict[str, Tuple[str, ...]] = {
    "demo": ("repeats",),
    "bench": ("repeats", "chunk_tokens", "threads", "hidden", "heads", "kv_groups"),
    "plan": ("gpus", "rollouts", "response_len", "prompts", "naive_positions"),
}


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The CLI's parser; only ``command``'s own arguments are added (its module imported)."""
    parser = _Parser(
        prog=PROG,
        description=(  # laid out as written (the formatter keeps descriptions' line breaks)
            "Exact branch replay for RL post-training on Megatron-Core: rollouts that share\n"
            "a prompt are deduplicated into a prefix tree and every unique token position is\n"
            "computed once, with gradients equal to running each rollout separately."
        ),
        epilog=f"{PROG} COMMAND --help shows a command's options and their defaults.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name, help_text in COMMANDS:
        if name != command:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        # the docstring keeps its Sphinx roles for the API docs; --help shows it as plain text
        p = sub.add_parser(name, help=help_text, description=plain_text(module.__doc__),
                           formatter_class=HelpFormatter)
        module.add_arguments(p)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="print the traceback of a failure")
        p.set_defaults(func=module.main)
    return parser


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def preflight(command: str, args: argparse.Namespace) -> None:
    """Check ``args`` of ``command`` before it runs (raises ValueError/OSError)."""
    for dest in POSITIVE.get(command, ()):
        value = getattr(args, dest, None)
        if value is not None and value < 1:
            raise ValueError(f"{_flag(dest)}: must be >= 1, got {value}")
    for dest, kind in INPUTS.get(command, ()):
        value = getattr(args, dest, None)
        if value is not None and kind in ("json", "bench-json"):
            what = ("a bench.json that megatron-branch bench wrote" if kind == "bench-json"
                    else "a Hugging Face config.json")
            # a results folder (or its manifest) stands for the bench files it lists
            paths = report_paths(value) if kind == "bench-json" else [value]
            for path in paths:
                check_input_json(_flag(dest), path, what)
    for dest, kind in OUTPUTS.get(command, ()):
        value = getattr(args, dest, None)
        if value is None:
            continue
        (check_output_file if kind == "file" else check_output_dir)(_flag(dest), value)
    if command == "plan":
        _preflight_plan(args)
    if command == "bench":
        _preflight_bench(args)
    if command == "bench-scale":
        _preflight_bench_scale(args)


def _preflight_bench(args) -> None:
    # the full config's defaults (the quick one's are the same widths)
    hidden, heads = getattr(args, "hidden", None) or 128, getattr(args, "heads", None) or 4
    groups = getattr(args, "kv_groups", None) or min(2, heads)
    if hidden % heads:
        raise ValueError(f"--heads {heads} does not divide --hidden {hidden}")
    if heads % groups:
        raise ValueError(f"--kv-groups {groups} does not divide --heads {heads}")


def _preflight_bench_scale(args) -> None:
    # the layout, before run_bench_scale spawns its TP x CP processes (a bad one failed
    # there after minutes, in every process)
    importlib.import_module("megatron_branch.commands.bench.scale").validate(args)


def _preflight_plan(args) -> None:
    mfu, naive = getattr(args, "mfu", None), getattr(args, "naive_positions", None)
    rollouts, response = getattr(args, "rollouts", 1) or 1, getattr(args, "response_len", 0) or 0
    if mfu is not None and not 0 < mfu <= 1:
        raise ValueError(f"--mfu: must be in (0, 1], got {mfu}")
    if naive:
        if naive % rollouts:
            raise ValueError(f"--naive-positions {naive} is not a multiple of --rollouts {rollouts}; "
                             f"give total positions = rollouts x (prompt + response)")
        if naive // rollouts - response < 1:
            raise ValueError(f"--naive-positions {naive}: leaves no prompt after --rollouts {rollouts} x "
                             f"--response-len {response}")
    elif getattr(args, "prompt_len", 1) < 1:
        raise ValueError(f"--prompt-len: must be >= 1, got {args.prompt_len}")


def _command_of(argv: Sequence[str]) -> Optional[str]:
    names = {name for name, _, _ in COMMANDS}
    return next((a for a in argv if a in names), None)


def _main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser(_command_of(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    preflight(args.command, args)
    return args.func(args)


def main(argv: Optional[List[str]] = None) -> int:
    command = _command_of(sys.argv[1:] if argv is None else argv)
    return run_main(_main, argv, prog=f"{PROG} {command}" if command else PROG)


if __name__ == "__main__":
    sys.exit(main())
