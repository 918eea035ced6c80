"""Launch branch-replay training through NeMo-Run: locally with torchrun, or on Slurm.

    python examples/nemo_run/launch.py local --nproc 2 -- --tp 2 --steps 2
    python examples/nemo_run/launch.py slurm --dryrun --gpus 8 --tp 2 --cp 4

``local`` runs ``examples/train_branch_replay.py`` with ``run.LocalExecutor(
ntasks_per_node=N, launcher="torchrun")``. ``slurm`` builds a ``run.SlurmExecutor`` job for
one node of ``--gpus`` GPUs with the TP/CP settings and, with ``--dryrun``, prints the
sbatch script instead of submitting (set --account/--partition/--job-dir for a real run).
Needs the ``[launch]`` extra (``nemo-run==0.11.1``, ``leptonai<0.47``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_branch_replay.py")


def make_script(train_args):
    import nemo_run as run

    return run.Script(path=SCRIPT, args=list(train_args), entrypoint="python")


def local(nproc: int, train_args, name: str = "branch-replay") -> None:
    import nemo_run as run

    # torchrun of this interpreter's environment (a venv's bin/ need not be on PATH)
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    executor = run.LocalExecutor(ntasks_per_node=nproc, launcher="torchrun",
                                 env_vars={"OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    with run.Experiment(name, executor=executor, log_level="WARN") as exp:
        exp.add(make_script(train_args), executor=executor, name="train")
        exp.run(detach=False)


def slurm(args) -> None:
    import nemo_run as run

    train_args = ["--tp", str(args.tp), "--cp", str(args.cp), "--pp", str(args.pp), "--steps", str(args.steps)]
    executor = run.SlurmExecutor(
        account=args.account, partition=args.partition, nodes=1, ntasks_per_node=args.gpus,
        gpus_per_node=args.gpus, time=args.time, launcher="torchrun",
        tunnel=run.LocalTunnel(job_dir=args.job_dir or tempfile.mkdtemp(prefix="nemo-run-")),
    )
    with run.Experiment("branch-replay-slurm", executor=executor, log_level="WARN") as exp:
        exp.add(make_script(train_args), executor=executor, name="train")
        if args.dryrun:
            exp.dryrun()
        else:
            exp.run(detach=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    lo = sub.add_parser("local", help="torchrun on this machine")
    lo.add_argument("--nproc", type=int, default=2)
    lo.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: arguments of train_branch_replay.py")
    sl = sub.add_parser("slurm", help="one Slurm node")
    sl.add_argument("--gpus", type=int, default=8)
    sl.add_argument("--tp", type=int, default=2)
    sl.add_argument("--cp", type=int, default=4)
    sl.add_argument("--pp", type=int, default=1)
    sl.add_argument("--steps", type=int, default=100)
    sl.add_argument("--account", default="your_account")
    sl.add_argument("--partition", default="gpu")
    sl.add_argument("--time", default="04:00:00")
    sl.add_argument("--job-dir", default=None)
    sl.add_argument("--dryrun", action="store_true", help="print the sbatch script, submit nothing")
    args = p.parse_args(argv)
    if args.mode == "local":
        train_args = [a for a in args.train_args if a != "--"]
        local(args.nproc, train_args)
    else:
        if args.tp * args.cp * args.pp != args.gpus:
            print(f"error: --tp {args.tp} x --cp {args.cp} x --pp {args.pp} must equal --gpus {args.gpus}",
                  file=sys.stderr)
            return 2
        slurm(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
