"""``megatron-branch``: the command-line entry point."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import List, Optional

from megatron_branch import demo
from megatron_branch.bench import cp as bench_cp
from megatron_branch.bench import run as bench_run
from megatron_branch.planner import plan as planner


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
    p_demo = sub.add_parser(
        "demo",
        help="naive vs branch replay on a small Llama-style model (timing and exactness)",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(p_demo)
    p_demo.set_defaults(func=demo.main)
    p_bench = sub.add_parser(
        "bench",
        help="branch replay vs naive and peer methods: time, FLOPs, memory, exactness",
        description=bench_run.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_run.add_arguments(p_bench)
    p_bench.set_defaults(func=bench_run.main)
    p_cp = sub.add_parser(
        "bench-cp",
        help="context-parallel replay on CPU processes: balance, time, bytes sent",
        description=bench_cp.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_cp.add_arguments(p_cp)
    p_cp.set_defaults(func=bench_cp.main)
    p_plan = sub.add_parser(
        "plan",
        help="choose TP/CP/PP, chunk, recompute and FP8 for a workload on a cluster",
        description=planner.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    planner.add_arguments(p_plan)
    p_plan.set_defaults(func=planner.main)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # megatron-core warns about Apex/TE fallbacks on every CPU import; they are expected.
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", module="megatron.core.transformer.transformer_config")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
