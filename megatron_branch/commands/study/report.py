"""The study's report: summary table, plots and JSON from :func:`run_study`'s result.

Per experiment and mode, over seeds: steps and update-seconds to reach the reward
threshold (on a moving mean over a tenth of the run), final reward (mean of the last tenth
of the steps), median seconds per update, speed-up per update vs naive (the ratio of
medians within each seed's lockstep run, then averaged; in wall-clock and in CPU time),
positions forward/backward per step and, for tail-only, the gradient bias against exact
(cosine, relative norm).
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Dict, List, Optional, Sequence

MODE_ORDER = ("naive", "exact", "exact-streaming", "tail-only")
COLORS = {"naive": "tab:gray", "exact": "tab:blue", "exact-streaming": "tab:green", "tail-only": "tab:red"}
# naive, exact and exact-streaming train identically: wide solid, dashed and dotted lines keep all three visible
STYLES = {"naive": ("-", 3.2), "exact": ("--", 1.8), "exact-streaming": (":", 1.8), "tail-only": ("-", 1.6)}


def _clean(values: Sequence[Optional[float]]) -> List[float]:
    return [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = _clean(values)
    return sum(vals) / len(vals) if vals else None


def _std(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = _clean(values)
    return statistics.pstdev(vals) if len(vals) > 1 else (0.0 if vals else None)


def smooth(values: Sequence[Optional[float]], window: int) -> List[Optional[float]]:
    """Trailing moving mean over ``window`` steps (missing values skipped)."""
    out = []
    for i in range(len(values)):
        out.append(_mean(values[max(0, i - window + 1): i + 1]))
    return out


def _cumsum(values: Sequence[float]) -> List[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


def window_of(steps: int) -> int:
    return max(1, steps // 10)


def _groups(report: dict) -> Dict[tuple, List[dict]]:
    groups: Dict[tuple, List[dict]] = {}
    for run in report["runs"]:
        groups.setdefault((run["algo"], run["task"], run["mode"]), []).append(run)
    return groups


def _experiments(report: dict) -> List[str]:
    seen = []
    for run in report["runs"]:
        key = f"{run['algo']}:{run['task']}"
        if key not in seen:
            seen.append(key)
    return seen


def summarize(report: dict) -> List[dict]:
    """One row per (algo, task, mode) with the numbers of the summary table."""
    threshold = report["config"]["threshold"]
    groups = _groups(report)
    rows = []
    for exp in _experiments(report):
        algo, task = exp.split(":")
        naive_by_seed = {r["seed"]: r for r in groups.get((algo, task, "naive"), [])}
        for mode in MODE_ORDER:
            runs = groups.get((algo, task, mode))
            if not runs:
                continue
            steps_hit, secs_hit, finals, speedups, cpu_speedups, medians = [], [], [], [], [], []
            for run in runs:
                n = len(run["reward"])
                sm = smooth(run["reward"], window_of(n))
                hit = next((i for i, v in enumerate(sm) if v is not None and v >= threshold), None)
                if hit is not None:
                    steps_hit.append(hit + 1)
                    secs_hit.append(_cumsum(run["seconds"])[hit])
                tail = max(1, n // 10)
                finals.append(_mean(run["reward"][-tail:]))
                med = statistics.median([s for s in run["seconds"] if s > 0] or [0.0])
                medians.append(med)
                naive = naive_by_seed.get(run["seed"])
                if naive and med > 0:
                    speedups.append(statistics.median([s for s in naive["seconds"] if s > 0]) / med)
                    cpu = statistics.median([s for s in run["cpu_seconds"] if s > 0] or [0.0])
                    if cpu > 0:
                        cpu_speedups.append(statistics.median([s for s in naive["cpu_seconds"] if s > 0]) / cpu)
            row = {
                "algo": algo, "task": task, "mode": mode, "seeds": len(runs),
                "reached": len(steps_hit), "steps_to_threshold": _mean(steps_hit) if steps_hit else None,
                "seconds_to_threshold": _mean(secs_hit) if secs_hit else None,
                "final_reward": _mean(finals), "final_reward_std": _std(finals),
                "seconds_per_update": _mean(medians), "speedup_per_update": _mean(speedups),
                "cpu_speedup_per_update": _mean(cpu_speedups),
                "positions_forward": _mean([_mean(r["positions_forward"]) for r in runs]),
                "positions_backward": _mean([_mean(r["positions_backward"]) for r in runs]),
                "final_reward_stem": _mean([_mean(r["reward_stem"][-max(1, len(r["reward"]) // 10):]) for r in runs]),
            }
            if mode == "tail-only":
                row["bias_cosine"] = _mean([_mean(r["bias_cosine"]) for r in runs])
                row["bias_rel_norm"] = _mean([_mean(r["bias_rel_norm"]) for r in runs])
            if algo == "dpo":
                tail = lambda r: max(1, len(r["reward"]) // 10)  # noqa: E731
                row["final_dpo_accuracy"] = _mean([_mean(r["dpo_accuracy"][-tail(r):]) for r in runs])
                row["final_dpo_margin"] = _mean([_mean(r["dpo_margin"][-tail(r):]) for r in runs])
            rows.append(row)
    return rows


def _fmt(v, spec: str, none: str = "—") -> str:
    return none if v is None else format(v, spec)


def format_table(report: dict) -> str:
    """The summary as a markdown table."""
    threshold = report["config"]["threshold"]
    head = ("| experiment | mode | final reward | stem acc. | steps to {t} | update s to {t} | s / update | "
            "speed-up / update (CPU time) | positions fwd / bwd per step | tail-only bias cos (rel. norm) |"
            ).format(t=threshold)
    lines = [head, "|" + "---|" * 10]
    for row in report.get("summary") or summarize(report):
        reached = f" ({row['reached']}/{row['seeds']})" if row["reached"] < row["seeds"] else ""
        bias = (f"{row['bias_cosine']:.3f} ({row['bias_rel_norm']:.2f})"
                if row.get("bias_cosine") is not None else "")
        final = f"{row['final_reward']:.3f} ± {row['final_reward_std']:.3f}"
        if row.get("final_dpo_accuracy") is not None:
            final += f" (DPO acc {row['final_dpo_accuracy']:.2f}, margin {row['final_dpo_margin']:.2f})"
        lines.append(
            f"| {row['algo']}:{row['task']} | {row['mode']} | {final} | {_fmt(row['final_reward_stem'], '.2f')} | "
            f"{_fmt(row['steps_to_threshold'], '.0f')}{reached} | {_fmt(row['seconds_to_threshold'], '.1f')} | "
            f"{row['seconds_per_update']:.3f} | {_fmt(row['speedup_per_update'], '.2f')}x "
            f"({_fmt(row['cpu_speedup_per_update'], '.2f')}x) | "
            f"{row['positions_forward']:.0f} / {row['positions_backward']:.0f} | {bias} |")
    return "\n".join(lines)


def _band(ax, xs, runs: List[dict], key: str, window: int, color: str, label: str,
          style: tuple = ("-", 1.6)) -> None:
    series = [smooth(r[key], window) for r in runs]
    n = min(len(s) for s in series)
    mean = [_mean([s[i] for s in series]) for i in range(n)]
    lo = [min(_clean([s[i] for s in series]) or [math.nan]) for i in range(n)]
    hi = [max(_clean([s[i] for s in series]) or [math.nan]) for i in range(n)]
    mean = [math.nan if v is None else v for v in mean]
    ax.plot(xs[:n], mean, color=color, label=label, ls=style[0], lw=style[1], alpha=0.9)
    if len(runs) > 1:
        ax.fill_between(xs[:n], lo, hi, color=color, alpha=0.15, lw=0)


def plot_rewards(report: dict, path: str) -> None:
    """Rows: experiments. Columns: reward vs step, reward vs cumulative update seconds,
    and stem-token accuracy vs step (DPO: the implicit-reward margin). Lines are the mean
    over seeds of a moving mean; bands span the seeds (min to max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(report)
    exps = _experiments(report)
    fig, axes = plt.subplots(len(exps), 3, figsize=(15, 3.3 * len(exps)), squeeze=False)
    for row, exp in enumerate(exps):
        algo, task = exp.split(":")
        for mode in MODE_ORDER:
            runs = groups.get((algo, task, mode))
            if not runs:
                continue
            n = min(len(r["reward"]) for r in runs)
            window = window_of(n)
            steps = list(range(1, n + 1))
            clock = [_mean(v) for v in zip(*[_cumsum(r["seconds"])[:n] for r in runs])]
            style = STYLES[mode]
            _band(axes[row][0], steps, runs, "reward", window, COLORS[mode], mode, style)
            _band(axes[row][1], clock, runs, "reward", window, COLORS[mode], mode, style)
            third = "dpo_margin" if algo == "dpo" else "reward_stem"
            _band(axes[row][2], steps, runs, third, window, COLORS[mode], mode, style)
        axes[row][0].set_title(f"{exp}: reward vs step")
        axes[row][1].set_title(f"{exp}: reward vs update wall-clock")
        axes[row][2].set_title(f"{exp}: " + ("DPO implicit-reward margin" if algo == "dpo"
                                             else "stem-token accuracy"))
        axes[row][0].set_xlabel("step"), axes[row][1].set_xlabel("cumulative update seconds (sampling excluded)")
        axes[row][2].set_xlabel("step")
        for ax in axes[row]:
            ax.grid(alpha=0.3)
        axes[row][0].set_ylabel("reward")
        axes[row][0].legend(fontsize=8)
    seeds = len(report["config"]["seeds"])
    fig.suptitle(f"branch replay study: mean of {seeds} seed(s), band = min..max over seeds, moving mean over "
                 f"a tenth of the run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_bias(report: dict, path: str) -> None:
    """Tail-only's gradient against the exact one at the same weights, over training:
    cosine similarity and relative norm, one line per experiment (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(report)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2))
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink"]
    for i, exp in enumerate(_experiments(report)):
        runs = groups.get(tuple(exp.split(":")) + ("tail-only",))
        if not runs:
            continue
        n = min(len(r["bias_cosine"]) for r in runs)
        window = window_of(n)
        steps = list(range(1, n + 1))
        _band(ax1, steps, runs, "bias_cosine", window, palette[i % len(palette)], exp)
        _band(ax2, steps, runs, "bias_rel_norm", window, palette[i % len(palette)], exp)
    ax1.set_title("tail-only vs exact gradient: cosine"), ax1.set_xlabel("step"), ax1.set_ylabel("cosine")
    ax2.set_title("tail-only vs exact gradient: |g_tail| / |g_exact|"), ax2.set_xlabel("step")
    ax1.axhline(1.0, color="k", lw=0.8, ls="--"), ax2.axhline(1.0, color="k", lw=0.8, ls="--")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
