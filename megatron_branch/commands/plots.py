"""Small matplotlib helpers shared by the examples (imported only when a plot is asked for)."""

from __future__ import annotations

from typing import Dict, List


def moving_mean(values: List[float], window: int) -> List[float]:
    """Trailing mean over at most ``window`` values."""
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


def reward_curve(history: List[Dict], path: str, title: str, label: str = "mean reward per step") -> None:
    """Write ``history``'s per-step ``reward`` and its moving mean to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    rewards = [h["reward"] for h in history]
    window = max(1, len(rewards) // 20)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, alpha=0.3, label=label)
    ax.plot(steps, moving_mean(rewards, window), label=f"moving mean ({window} steps)")
    ax.set_xlabel("step"), ax.set_ylabel("reward"), ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
