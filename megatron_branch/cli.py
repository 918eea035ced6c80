"""``megatron-branch``: the command-line entry point."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import List, Optional

# megatron-core warns about Apex/TE fallbacks when imported on CPU; they are expected here.
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", module="megatron.core.transformer.transformer_config")

from megatron_branch import demo  # noqa: E402
from megatron_branch.bench import cp as bench_cp  # noqa: E402
from megatron_branch.bench import run as bench_run  # noqa: E402
from megatron_branch.bench import scale as bench_scale  # noqa: E402
from megatron_branch.planner import plan as planner  # noqa: E402

# (name, module with add_arguments/main and a docstring, one-line help)
COMMANDS = (
    ("demo", demo, "naive vs branch replay on a small Llama-style model (timing and exactness)"),
    ("bench", bench_run, "branch replay vs naive and peer methods: time, FLOPs, memory, exactness"),
    ("bench-cp", bench_cp, "context-parallel replay on CPU processes: balance, time, bytes sent"),
    ("bench-scale", bench_scale, "the headline workload scaled down: measured per-rank memory vs the planner"),
    ("plan", planner, "choose TP/CP/PP, chunk, recompute and FP8 for a workload on a cluster"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-branch",
        description=(
            "Exact branch replay for RL post-training on Megatron-Core: rollouts that share "
            "a prompt are deduplicated into a prefix tree and every unique token position is "
            "computed once, with gradients equal to running each rollout separately."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, help_text in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.main)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
