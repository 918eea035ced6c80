"""``examples/grpo_tree.py``: branch replay trains exactly like the naive update."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
    spec = importlib.util.spec_from_file_location("grpo_tree", os.path.join(ROOT, "examples", "grpo_tree.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tree_and_naive_updates_agree_and_reward_rises():
    grpo = _example()
    tree = grpo.train(grpo.parse_args(["--steps", "60", "--prompt-len", "64"]), echo=lambda *_: None)
    naive = grpo.train(grpo.parse_args(["--steps", "5", "--naive", "--prompt-len", "64"]), echo=lambda *_: None)
    for a, b in zip(tree[:5], naive):
        assert a["reward"] == b["reward"]  # same samples: the policies stayed identical
        assert abs(a["loss"] - b["loss"]) < 1e-5
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"]
    first = sum(h["reward"] for h in tree[:10]) / 10
    last = sum(h["reward"] for h in tree[-10:]) / 10
    assert last > first + 0.1, (first, last)
