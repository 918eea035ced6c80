"""Launch branch-replay training through NeMo-Run: locally with torchrun, or on Slurm.

    python examples/nemo_run/launch.py local --nproc 2 -- --tp 2 --steps 2
    python examples/nemo_run/launch.py slurm --dryrun --gpus 8 --tp 2 --cp 4

``local`` runs ``examples/train_branch_replay.py`` with ``run.LocalExecutor(
ntasks_per_node=N, launcher="torchrun")``. ``slurm`` builds a ``run.SlurmExecutor`` job for
one node of ``--gpus`` GPUs with the TP/CP settings and, with ``--dryrun``, prints the
sbatch script instead of submitting (set --account/--partition/--job-dir for a real run).
Needs the ``[launch]`` extra (``nemo-run==0.11.1``, ``leptonai<0.47``).

Where the output goes (printed at the end of each run): NeMo-Run keeps an experiment in
``$NEMORUN_HOME/experiments/<title>/<title>_<id>/`` (``NEMORUN_HOME`` defaults to
``~/.nemo_run``); the task's folder is ``train/`` in it. ``local``: all ranks' output in
``train/nemo_run/train-*/train/0/combined.log`` (also ``stdout.log``, ``stderr.log``), each
rank's own in ``train/nemo_run/train-*/torchelastic/train/*/attempt_0/<rank>/stdout.log``;
``nemo experiment logs <title>_<id> 0`` prints them. ``slurm``: on the cluster, in
``<--job-dir>/branch-replay-slurm/branch-replay-slurm_<id>/train/`` (``sbatch_*_<jobid>.out``
and the job's ``log-*_<jobid>_<restart>.out``).
"""

from __future__ import annotations

import argparse
import glob
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
    print_output_dir(exp.jobs[0].executor.job_dir)


def print_output_dir(job_dir: str, remote: bool = False) -> None:
    """Say where the task's output and logs are (NeMo-Run prints the folder once, mid-run).

    Args:
        job_dir: the task's folder (``<experiment dir>/train``).
        remote: a Slurm job's folder on the cluster (its log files do not exist here yet).
    """
    experiment = os.path.basename(os.path.dirname(job_dir))
    if remote:
        print(f"output and logs on the cluster: {job_dir}/ (sbatch_*_<jobid>.out, log-*_<jobid>_<restart>.out)")
        return
    print(f"output and logs: {job_dir}/")
    for path in sorted(glob.glob(os.path.join(job_dir, "nemo_run", "*", "train", "0", "combined.log"))):
        print(f"  all ranks: {path}")
    for path in sorted(glob.glob(os.path.join(job_dir, "nemo_run", "*", "torchelastic", "*", "*", "*", "*",
                                              "stdout.log"))):
        print(f"  rank {os.path.basename(os.path.dirname(path))}: {path}")
    print(f"  or: nemo experiment logs {experiment} 0")


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
    print_output_dir(os.path.join(exp.jobs[0].executor.tunnel.job_dir, "train"), remote=True)


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
