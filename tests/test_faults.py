"""Faults and bad input: no hangs, one-line errors, numerical guards.

* a rank that raises (real gloo processes under torchrun, injected with
  ``$MEGATRON_BRANCH_FAULT``) is named, and the other ranks are stopped within seconds;
* a rank that hangs makes the others' collectives time out (``$MEGATRON_BRANCH_TIMEOUT``)
  with a message naming the rank that fell behind;
* the CLI and the example refuse bad flags, missing/corrupt files and unwritable targets
  before any heavy work, with one line naming the flag and exit code 2 (traceback only
  with ``--debug``);
* NaN/Inf is reported where it first appears (:mod:`megatron_branch.training.finite_guard`), and the
  losses refuse NaN advantages, masks, rewards and old log-probs.
"""

import importlib.util
import os
import re
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from torchrun import ROOT, TRAIN

import megatron_branch as mb
from megatron_branch import cli, losses
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.distributed import default_timeout, free_port, run_main
from megatron_branch.spec.builders import build_gpt, llama_config
from megatron_branch.training.finite_guard import FiniteGuard, NonFiniteError

VOCAB = 128


# ------------------------------------------------------------------ multi-process faults
def launch_with_fault(fault, timeout_s, marker):
    """torchrun, 2 gloo ranks, with a fault; returns (returncode, stderr lines with
    arrival times, time the ``marker`` line arrived, end time, worker pids)."""
    env = dict(os.environ, MEGATRON_BRANCH_FAULT=fault, MEGATRON_BRANCH_TIMEOUT=str(timeout_s))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           TRAIN, "--steps", "3"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines, seen = [], {}
    workers = set()

    def read():
        for line in proc.stderr:
            lines.append(line.rstrip())
            if marker in line and "marker" not in seen:
                seen["marker"] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            workers |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    end = time.monotonic()
    reader.join(timeout=10)
    return proc.returncode, lines, seen.get("marker"), end, workers


def test_a_failing_rank_is_named_and_the_others_stop():
    rc, lines, failed_at, end, workers = launch_with_fault("1:1:raise", 120, "rank 1 failed")
    text = "\n".join(lines)
    assert rc != 0
    assert "rank 1 failed: RuntimeError: injected fault at step 1 (MEGATRON_BRANCH_FAULT)" in text, text[-3000:]
    assert failed_at is not None and end - failed_at < 30, end - failed_at  # not the 120 s timeout
    assert not [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert "Traceback (most recent call last):\n  File \"" + TRAIN not in text  # no worker traceback


def test_a_stuck_rank_times_out_and_is_named():
    rc, lines, hung_at, end, workers = launch_with_fault("1:1:hang", 8, "hanging at step 1")
    text = "\n".join(lines)
    assert rc != 0
    line = next((x for x in lines if x.startswith("rank 0 failed")), "")
    assert "rank 1 fell behind (last seen at 'step 1: start'" in line, text[-3000:]
    assert "MEGATRON_BRANCH_TIMEOUT" in line
    assert hung_at is not None and end - hung_at < 8 + 30, end - hung_at
    assert not [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_timeout_setting(monkeypatch):
    monkeypatch.delenv("MEGATRON_BRANCH_TIMEOUT", raising=False)
    assert default_timeout() == 600.0
    monkeypatch.setenv("MEGATRON_BRANCH_TIMEOUT", "12.5")
    assert default_timeout() == 12.5
    monkeypatch.setenv("MEGATRON_BRANCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MEGATRON_BRANCH_TIMEOUT='soon': must be a positive number"):
        default_timeout()


# ------------------------------------------------------------------- one-line failures
def one_line(capsys):
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, expect", [
    (["plan", "--hf-config", "/nonexistent/config.json"], "megatron-branch plan: error: --hf-config "
                                                          "/nonexistent/config.json: no such file"),
    (["plan", "--hf-config", "{corrupt}"], "not valid JSON"),
    (["plan", "--hf-config", "{lacking}"], "config.json lacks num_hidden_layers"),
    (["plan", "--naive-positions", "1001", "--rollouts", "16"], "not a multiple of --rollouts 16"),
    (["plan", "--mfu", "1.5"], "--mfu: must be in (0, 1]"),
    (["plan", "--gpus", "0"], "--gpus: must be >= 1"),
    (["plan", "--json", "/nonexistent/plan.json"], "directory /nonexistent does not exist"),
    (["demo", "--json", "{dir}"], "megatron-branch demo: error: --json {dir}: is a directory"),
    (["demo", "--repeats", "0"], "--repeats: must be >= 1"),
    (["bench", "--out", "{file}"], "--out {file}: is a file, not a directory"),
    (["bench-cp", "--out", "{file}/sub"], "is a file; choose a directory"),
    (["bench", "--threads", "0"], "--threads: must be >= 1"),
    (["study", "--naive-micro-batch", "0"], "naive_micro_batch: must be a positive number"),
    (["study", "--out", "{file}"], "is a file"),
    (["bench-scale", "--json", "{dir}"], "is a directory; give a file path"),
    (["demo", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_cli_fails_cleanly_before_any_work(argv, expect, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    (tmp_path / "corrupt.json").write_text("{not json")
    (tmp_path / "lacking.json").write_text('{"hidden_size": 8}')
    subs = {"{dir}": str(tmp_path), "{file}": str(tmp_path / "file"), "{corrupt}": str(tmp_path / "corrupt.json"),
            "{lacking}": str(tmp_path / "lacking.json")}

    def fill(s):
        for k, v in subs.items():
            s = s.replace(k, v)
        return s

    start = time.monotonic()
    try:
        code = cli.main([fill(a) for a in argv])
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    assert code == 2 and time.monotonic() - start < 5
    assert fill(expect) in one_line(capsys)


@pytest.mark.parametrize("sizes, shape, expect", [
    ((1, 0), {}, "bench-cp sizes (1, 0): CP sizes >= 1, starting with 1"),
    ((2, 4), {}, "starting with 1"),
    ((1, 2), {"hidden": 66}, "hidden 66 is not a multiple of the model's 4 heads"),
    ((1, 2), {"tails": 0}, "tails must be >= 1, got 0"),
])
def test_bench_cp_refuses_a_bad_shape_before_spawning(sizes, shape, expect, monkeypatch):
    from megatron_branch.commands.bench import cp

    def spawn(*args, **kwargs):
        raise AssertionError("bench-cp spawned processes for a shape it should have refused")

    monkeypatch.setattr(cp.mp, "spawn", spawn)
    with pytest.raises(ValueError, match=re.escape(expect)):
        cp.run_bench_cp(True, sizes=sizes, echo=lambda *_: None, shape=shape)


def test_plan_that_does_not_fit_exits_1(capsys):
    argv = ["plan", "--model", "Qwen2.5-32B", "--prompt-len", "1000000", "--gpu", "H100", "--gpus", "1"]
    assert cli.main(argv) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_cli_debug_shows_the_traceback(capsys):
    assert cli.main(["--debug", "plan", "--hf-config", "/nonexistent.json"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "FileNotFoundError" in err


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_branch_replay_example", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_fails_cleanly_before_any_work(example, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "latest").write_text("1")
    (tmp_path / "old" / "iter_0000001").mkdir()
    cases = [
        (["--load", str(tmp_path / "missing")], "--load " + str(tmp_path / "missing") + ": no such directory"),
        (["--load", str(tmp_path)], "holds no checkpoint (no latest file)"),
        (["--save", str(tmp_path / "file")], "is a file, not a directory"),
        (["--save", str(tmp_path / "old")], "already holds checkpoints (latest iteration 1); resume with --load"),
        (["--dump-params", str(tmp_path / "no" / "p.st")], "does not exist; create it first"),
        (["--save-interval", "2"], "--save-interval: needs --save DIR"),
        (["--optimizer", "torch", "--load", str(tmp_path)], "--save/--load: checkpoints hold Megatron optimizer state"),
        (["--micro-batch-tokens", "0"], "--micro-batch-tokens: must be >= 1"),
    ]
    for argv, expect in cases:
        try:
            code = run_main(example.main, argv, prog="train_branch_replay.py")
        except SystemExit as e:
            code = e.code
        assert code == 2, argv
        assert expect in one_line(capsys), argv


# ---------------------------------------------------------------------- numerical guards
def model_and_tree():
    config = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2)
    model = build_gpt(config, VOCAB, seed=0)
    batch = branching_rollouts([12, 9], [2], [4], VOCAB, seed=3)
    return model, mb.BranchTree.from_sequences(batch.sequences), batch


def test_guard_off_costs_nothing():
    model, _, _ = model_and_tree()
    guard = FiniteGuard(model, enabled=False)
    fn = lambda lp, ids: lp.sum()  # noqa: E731
    assert guard.hooks == 0 and guard.wrap_loss(fn) is fn
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with FiniteGuard(model) as on:
        assert on.hooks == 1 + 5  # the model's pre-hook; embedding, 2 layers, final norm, output layer
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_nan_weight_is_reported_at_its_layer():
    model, tree, _ = model_and_tree()
    with torch.no_grad():
        model.decoder.layers[1].mlp.linear_fc1.weight[0, 0] = float("nan")
    with FiniteGuard(model) as guard, pytest.raises(NonFiniteError) as err:
        guard.step = 7
        mb.rollout_logprobs(model, tree)
    msg = str(err.value)
    assert msg.startswith("step 7: NaN in the forward output of decoder.layers.1 at packed token 0")
    assert "its parameters are already non-finite (mlp.linear_fc1.weight)" in msg


def test_nan_embedding_row_names_the_rollouts_that_contain_the_token():
    model, tree, batch = model_and_tree()
    token = int(batch.sequences[3][-1])  # the last token of rollout 3 (a tail token)
    with torch.no_grad():
        model.embedding.word_embeddings.weight[token] = float("inf")
    with FiniteGuard(model) as guard, pytest.raises(NonFiniteError) as err:
        guard.step = 2
        mb.rollout_logprobs(model, tree)
    msg = str(err.value)
    first = next(i for i in range(tree.unique_positions) if int(tree.tokens[i]) == token)
    holders = (tree.rows == first).any(1).nonzero().flatten().tolist()
    assert f"step 2: Inf in the forward output of embedding at packed token {first}" in msg
    assert f"rollout(s) {', '.join(map(str, holders))} of this micro-batch" in msg
    assert "its parameters are already non-finite (word_embeddings.weight)" in msg


def test_nan_gradient_is_reported_where_it_enters_the_backward():
    model, tree, _ = model_and_tree()
    with FiniteGuard(model) as guard:
        guard.step = 4
        lp = mb.rollout_logprobs(model, tree)
        # finite value, NaN gradient: the unselected branch's sqrt(-1) gets a zero upstream grad
        loss = torch.where(torch.ones_like(lp, dtype=torch.bool), lp, (lp - 1.0).sqrt()).sum()
        assert torch.isfinite(loss)
        with pytest.raises(NonFiniteError, match="step 4: NaN in the gradient flowing into the output of "
                                                 "output_layer .*arose in the backward of the loss"):
            loss.backward()


def test_guarded_loss_names_the_rollout_and_the_gradient_check_the_parameter():
    model, tree, _ = model_and_tree()
    guard = FiniteGuard(model, activations=False)
    guard.step = 5
    lp = torch.zeros(3, 6)
    lp[2, 4] = float("nan")
    loss_fn = guard.wrap_loss(lambda lp, ids: (lp.sum(), torch.ones(())))
    with pytest.raises(NonFiniteError, match="step 5: NaN log-prob of rollout 12 at token 5"):
        loss_fn(lp, torch.tensor([10, 11, 12]))
    bad_loss = guard.wrap_loss(lambda lp, ids: lp.sum() / 0.0 * 0.0)
    with pytest.raises(NonFiniteError, match="NaN loss from loss_fn on rollouts 0, 1, 2 although its log-probs"):
        bad_loss(torch.zeros(3, 6), torch.arange(3))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model.decoder.layers[0].self_attention.linear_qkv.weight.grad[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"step 5: non-finite gradient in decoder\.layers\.0\.self_attention"
                                             r"\.linear_qkv\.weight"):
        guard.check_grads()
    guard.check_params()  # all finite


def test_losses_refuse_nan_inputs_naming_the_field():
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.ones(2, 3)
    adv = torch.tensor([1.0, float("nan")])
    with pytest.raises(ValueError, match=r"advantages: 1 NaN value\(s\), first at index \(1,\)"):
        losses.ppo_policy_loss(lp, lp.detach(), adv, mask)
    bad_mask = torch.tensor([[1.0, float("inf"), 0.0], [1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match="mask: 1 Inf value"):
        losses.grpo_policy_loss(lp, lp.detach(), torch.ones(2), bad_mask)
    with pytest.raises(ValueError, match="old_logprobs: 1 NaN"):
        old = lp.detach().clone()
        old[0, 2] = float("nan")
        losses.dapo_policy_loss(lp, old, torch.ones(2), mask)
    with pytest.raises(ValueError, match="rewards: 1 NaN"):
        losses.grpo_advantages(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match="mask: 1 NaN"):
        losses.sft_loss(lp, torch.tensor([[1.0, float("nan"), 0.0], [1.0, 1.0, 1.0]]))
    old = lp.detach().clone()
    old[0, 0] = float("-inf")  # a zero-probability behaviour token under a zero mask is allowed
    m = mask.clone()
    m[0, 0] = 0.0
    loss, _ = losses.ppo_policy_loss(lp, old, torch.ones(2), m)
    assert torch.isfinite(loss)
