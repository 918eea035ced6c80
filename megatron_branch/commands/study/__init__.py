"""``megatron-branch study``: convergence and wall-clock of naive, exact and tail-only training.

Trains the same tiny Llama-style policy from the same seed with four ways of computing
the update — ``naive`` (every rollout in full), ``exact`` (branch replay, one pass),
``exact-streaming`` (branch replay in chunks) and ``tail-only`` (streaming with the shared
stems as constants) — on verifiable toy tasks with tree sampling, for GRPO, PPO (value-free
tree baseline) and DPO (pairs sharing the prompt and a response stem). Per step it records
reward (DPO: also accuracy and margin), loss, gradient norm, tail-only's gradient bias
against exact, positions computed and the wall-clock of the update.

Exactness guard: naive and the exact modes must agree in reward, loss and gradient norm
over the first steps (1e-5 relative, fp32), or the study stops with an error (exit 1).

Prints the summary table (markdown) and writes OUT/study.json (per-step series, summary,
guard), OUT/study_reward.png and OUT/study_bias.png.
"""

from __future__ import annotations

import os
import sys

from megatron_branch.commands.preflight import preset_default
from megatron_branch.commands.study import report as rep
from megatron_branch.commands.study.algos import ALGOS
from megatron_branch.commands.study.run import MODES, StudyConfig, StudyError, run_study
from megatron_branch.commands.study.tasks import TASKS

__all__ = ["add_arguments", "main"]


def add_arguments(parser) -> None:
    # the options left None take the preset's value (StudyConfig or StudyConfig.quick()), stated in the help
    full, quick = StudyConfig(), StudyConfig.quick()
    parser.add_argument("--quick", action="store_true",
                        help="tiny setting (one seed, a few steps; < 3 minutes on 2 cores; used by the tests)")
    parser.add_argument("--out", default="study_out", help="directory for study.json and the PNGs")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the JSON here instead of OUT/study.json")
    parser.add_argument("--experiments", nargs="+", default=None, metavar="ALGO:TASK",
                        help=f"what to train: algorithms {', '.join(sorted(ALGOS))} on tasks "
                             f"{', '.join(sorted(TASKS))} {preset_default(full.experiments, quick.experiments)}")
    parser.add_argument("--modes", nargs="+", default=None, choices=list(MODES),
                        help=f"ways to compute the update {preset_default(full.modes, quick.modes)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=None,
                        help=f"policy and sampling seeds {preset_default(full.seeds, quick.seeds)}")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"sampling steps per run {preset_default(full.steps, quick.steps)}")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help=f"prompt tokens {preset_default(full.prompt_len, quick.prompt_len)}")
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help="streaming budget (default: tails x tail length)")
    parser.add_argument("--naive-micro-batch", type=int, default=None, metavar="N",
                        help="rollouts per naive micro-batch (default: all in one batch); time 1, 2, 4, ... "
                             "and compare against the fastest")
    per_algo = "".join(f", {a} {lr:g}" for a, lr in sorted(full.lr_by_algo.items()))
    parser.add_argument("--lr", type=float, default=None,
                        help=f"AdamW learning rate for every algorithm (default: {full.lr:g}{per_algo})")
    parser.add_argument("--threshold", type=float, default=None,
                        help=f"reward threshold for the summary {preset_default(full.threshold, quick.threshold)}")
    parser.add_argument("--threads", type=int, default=None,
                        help=f"torch threads {preset_default(full.threads, quick.threads)}")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    parser.add_argument("--verbose", action="store_true",
                        help="the progress bar even when stderr is not a terminal (there: a line every few seconds)")


def main(args) -> int:
    cfg = StudyConfig.quick() if args.quick else StudyConfig()
    for name in ("experiments", "modes", "seeds", "steps", "prompt_len", "chunk_tokens", "lr", "threshold",
                 "threads", "naive_micro_batch"):
        value = getattr(args, name)
        if value is not None:
            setattr(cfg, name, value)
    if args.lr is not None:
        cfg.lr_by_algo = {}  # one learning rate for every algorithm
    try:
        cfg.__post_init__()
    except ValueError as exc:
        print(f"megatron-branch study: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_study(cfg, verbose=args.verbose)
    except StudyError as exc:
        print(f"megatron-branch study: {exc}", file=sys.stderr)
        return 1
    result["summary"] = rep.summarize(result)
    table = rep.format_table(result)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    json_path = args.json or os.path.join(args.out, "study.json")
    rep.write_json(result, json_path)
    written = [json_path]
    if not args.no_plots:
        for name, fn in (("study_reward.png", rep.plot_rewards), ("study_bias.png", rep.plot_bias)):
            fn(result, os.path.join(args.out, name))
            written.append(os.path.join(args.out, name))
    print("wrote " + ", ".join(written))
    return 0
