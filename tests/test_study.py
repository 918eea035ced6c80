"""``megatron-branch study``: naive = exact over the first steps, tail-only is biased and says
so, DPO pairs through branch replay equal naive DPO, the guard can fail, the report."""

import json

import pytest
import torch
from conftest import make_pair

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch.commands.study import report as rep
from megatron_branch.commands.study import run as study_run
from megatron_branch.commands.study.algos import get_algo, preference_pairs, tree_advantages
from megatron_branch.commands.study.run import RunRecord, StudyConfig, StudyError, check_exact, gradient_bias, run_study
from megatron_branch.commands.study.sampling import TreeSample
from megatron_branch.commands.study.tasks import get_task, opener_tokens
from megatron_branch.reference.agreement import compare_grads, grads
from megatron_branch.reference.naive import naive_rollout_logprobs

ISSUE_KEYS = {"algo", "mode", "seed", "reward", "loss", "grad_norm", "bias_cosine", "seconds"}


@pytest.fixture(scope="module")
def quick():
    result = run_study(StudyConfig.quick(), echo=lambda *_: None, progress=False)
    result["summary"] = rep.summarize(result)
    return result


def _runs(result, experiment):
    algo, task = experiment.split(":")
    return {r["mode"]: r for r in result["runs"] if r["algo"] == algo and r["task"] == task}


def test_quick_naive_equals_exact_over_the_first_steps(quick):
    cfg = quick["config"]
    assert quick["guard"]["passed"] and quick["guard"]["steps"] == cfg["guard_steps"] >= 2
    assert set(quick["guard"]["modes"]) == {"exact", "exact-streaming"}
    for experiment in cfg["experiments"]:
        runs = _runs(quick, experiment)
        naive = runs["naive"]
        for mode in ("exact", "exact-streaming"):
            r = runs[mode]
            for step in range(cfg["guard_steps"]):
                assert r["reward"][step] == naive["reward"][step], (experiment, mode, step)  # same samples
                for a, b in zip(r["loss_epochs"][step], naive["loss_epochs"][step]):
                    assert abs(a - b) <= 1e-5 * max(abs(a), abs(b), 1e-2), (experiment, mode, step)
                for a, b in zip(r["grad_norm_epochs"][step], naive["grad_norm_epochs"][step]):
                    assert a > 0 and abs(a - b) <= 1e-5 * b, (experiment, mode, step)
            # the replay computes far fewer positions than naive
            assert r["positions_forward"][0] < naive["positions_forward"][0]


def test_quick_tail_only_differs_and_reports_its_bias(quick):
    for experiment in quick["config"]["experiments"]:
        runs = _runs(quick, experiment)
        tail, exact = runs["tail-only"], runs["exact"]
        # step 0: same weights and samples, so the gradients differ only by the detached stems
        assert tail["reward"][0] == exact["reward"][0]
        assert abs(tail["grad_norm"][0] - exact["grad_norm"][0]) > 1e-3 * exact["grad_norm"][0], experiment
        cos = [c for c in tail["bias_cosine"] if c is not None]
        assert len(tail["bias_cosine"]) == quick["config"]["steps"] and cos
        assert all(-1.0 <= c < 0.999 for c in cos), (experiment, cos)
        assert all(e > 1e-3 for e in tail["bias_rel_error"] if e is not None)
        assert tail["positions_backward"][0] < exact["positions_backward"][0]
        assert exact["bias_cosine"] == []


def test_quick_json_schema_and_report(quick, tmp_path):
    cfg = quick["config"]
    assert len(quick["runs"]) == len(cfg["experiments"]) * len(cfg["seeds"]) * len(cfg["modes"])
    for run in quick["runs"]:
        assert ISSUE_KEYS <= set(run) and run["algo"] in ("grpo", "ppo", "dpo")
        for key in ("reward", "loss", "grad_norm", "seconds", "cpu_seconds", "positions_forward"):
            assert len(run[key]) == cfg["steps"], key
        skipped = [run["algo"] == "dpo" and n == 0 for n in run["dpo_pairs"]]  # every pair tied: no update
        assert all((s == 0) if skip else (s > 0) for s, skip in zip(run["seconds"], skipped))
        if run["algo"] == "dpo":
            assert all(0.0 <= a <= 1.0 for a in run["dpo_accuracy"] if a is not None)
    rows = {(r["algo"], r["task"], r["mode"]): r for r in quick["summary"]}
    assert rows[("grpo", "count-up", "naive")]["speedup_per_update"] == pytest.approx(1.0)
    assert rows[("grpo", "opener", "tail-only")]["bias_cosine"] < 1.0
    table = rep.format_table(quick)
    assert "speed-up / update" in table and "tail-only" in table
    rep.plot_rewards(quick, str(tmp_path / "r.png"))
    rep.plot_bias(quick, str(tmp_path / "b.png"))
    assert (tmp_path / "r.png").stat().st_size > 10_000 and (tmp_path / "b.png").stat().st_size > 10_000
    json.dumps(quick)


def test_guard_stops_a_study_whose_replay_is_not_exact(monkeypatch, tmp_path):
    real = study_run.replay_step

    def off_by_a_little(model, tree, loss_fn, **kwargs):  # a replay that is 1e-3 off
        return real(model, tree, lambda lp, ids: loss_fn(lp, ids) * 1.001, **kwargs)

    monkeypatch.setattr(study_run, "replay_step", off_by_a_little)
    cfg = StudyConfig.quick()
    cfg.experiments, cfg.modes, cfg.steps = ["grpo:count-up"], ["naive", "exact"], 1
    with pytest.raises(StudyError, match="exactness guard: grpo:count-up seed 0 step 0: grad_norm"):
        run_study(cfg, echo=lambda *_: None, progress=False)
    from megatron_branch import cli

    code = cli.main(["study", "--quick", "--experiments", "grpo:count-up", "--modes", "naive", "exact",
                     "--steps", "1", "--out", str(tmp_path)])
    assert code == 1 and not (tmp_path / "study.json").exists()


def test_check_exact_by_hand():
    def rec(mode, loss, norm, reward=0.5):
        r = RunRecord("grpo", "count-up", mode, 0, None)
        r.reward, r.loss_epochs, r.grad_norm_epochs = [reward], [[loss]], [[norm]]
        return r

    ok = {"naive": rec("naive", 1e-9, 0.7), "exact": rec("exact", -2e-9, 0.7 * (1 + 3e-6))}
    worst = check_exact(ok, 0, 1e-5)  # a vanishing surrogate compares absolutely
    assert worst["grad_norm"] == pytest.approx(3e-6, rel=1e-3)
    with pytest.raises(StudyError, match="reward"):
        check_exact({"naive": rec("naive", 0.1, 0.7), "exact-streaming": rec("exact-streaming", 0.1, 0.7, 0.6)},
                    0, 1e-5)


def test_cli_study_writes_issue_json(tmp_path):
    from megatron_branch import cli

    path = tmp_path / "out.json"
    code = cli.main(["study", "--quick", "--experiments", "dpo:count-up", "--steps", "2", "--out", str(tmp_path),
                     "--json", str(path), "--no-plots"])
    assert code == 0
    data = json.loads(path.read_text())
    assert {r["mode"] for r in data["runs"]} == {"naive", "exact", "exact-streaming", "tail-only"}
    assert all(ISSUE_KEYS <= set(r) for r in data["runs"])
    assert not (tmp_path / "study_reward.png").exists()  # --no-plots
    assert cli.main(["study", "--quick", "--experiments", "sft:count-up"]) == 2


# ----------------------------------------------------------------------------- pieces
def test_dpo_pairs_through_branch_replay_equal_naive_dpo():
    """Pairs share the prompt and a response stem. The DPO loss and every gradient through
    branch replay (one pass; streaming with pair groups) equal the stock spec's, each
    rollout run alone (the truth) — for a plain DPO loss and for the study's own."""
    branch, stock = make_pair()
    gen = torch.Generator().manual_seed(3)
    prompt_len, pairs = 30, 3
    seqs = []
    for _ in range(pairs):
        stem = torch.randint(0, 128, (prompt_len + 5,), generator=gen)
        seqs += [torch.cat([stem, torch.randint(0, 128, (n,), generator=gen)]) for n in (7, 9)]
    mask = losses.response_mask([s.numel() for s in seqs], [prompt_len] * len(seqs))
    ref = torch.randn(mask.shape, generator=gen) * mask * 0.1  # a reference policy's log-probs
    group_ids = [i // 2 for i in range(len(seqs))]

    def dpo(lp, ids):
        seq = losses.sequence_logprobs(lp, mask[ids])
        ref_seq = losses.sequence_logprobs(ref[ids], mask[ids])
        return losses.dpo_loss(seq[0::2], seq[1::2], ref_seq[0::2], ref_seq[1::2], beta=0.5, global_pairs=pairs)[0]

    stock.zero_grad(set_to_none=True)
    truth = dpo(naive_rollout_logprobs(stock, seqs), torch.arange(len(seqs)))
    truth.backward()
    want = grads(stock)
    # the study's DPO: chosen (reward 1) first in each pair, so the same order and pairs
    sample = TreeSample(seqs, prompt_len, 5, 7, pairs, 1, 2)
    prep = get_algo("dpo").prepare(sample, torch.tensor([1.0, 0.0] * pairs), _Cfg())
    assert prep.group_ids == group_ids and all(a is b for a, b in zip(prep.sequences, seqs))
    assert torch.equal(prep.score_mask, mask)
    tree = mb.BranchTree.from_sequences(seqs, vocab_size=128)
    for name, loss_fn, kwargs in (
        ("one pass", dpo, {}),
        ("streaming", dpo, {"max_chunk_tokens": 20, "group_ids": group_ids}),
        ("study loss, streaming", prep.make_loss(ref), {"max_chunk_tokens": 20, "group_ids": prep.group_ids}),
    ):
        branch.zero_grad(set_to_none=True)
        stats = mb.replay_step(branch, tree, loss_fn, score_mask=mask, **kwargs)
        assert abs(stats.loss - float(truth)) <= 1e-5 * abs(float(truth)), name
        diffs = compare_grads(grads(branch), want)
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < 1e-5, (name, worst, diffs[worst])
        if kwargs:
            assert stats.num_stems > 0, name  # the shared prompt + stem really was a cached stem
    assert set(prep.make_loss(ref).summary()) == set()


class _Cfg:
    dpo_beta = 0.5


def test_gradient_bias_matches_prefix_grad_bias(model_pair):
    branch, _ = model_pair
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 128, (30,), generator=gen)
    stems = [torch.cat([prompt, torch.randint(0, 128, (4,), generator=gen)]) for _ in range(2)]
    seqs = [torch.cat([s, torch.randint(0, 128, (6,), generator=gen)]) for s in stems for _ in range(3)]
    sample = TreeSample(seqs, 30, 4, 6, 1, 2, 3)
    prep = get_algo("grpo").prepare(sample, torch.rand(len(seqs), generator=gen), None)
    loss_fn = prep.make_loss(None)
    tree = mb.BranchTree.from_sequences(seqs, vocab_size=128)
    want = mb.prefix_grad_bias(branch, tree, loss_fn, max_chunk_tokens=18, score_mask=prep.score_mask)
    branch.zero_grad(set_to_none=True)
    mb.replay_step(branch, tree, loss_fn, max_chunk_tokens=18, prefix_grad="detached", score_mask=prep.score_mask)
    before = [p.grad.clone() if p.grad is not None else None for p in branch.parameters()]
    got = gradient_bias(branch, tree, loss_fn, prep)
    for key in ("cosine", "rel_norm", "rel_error"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert 0.0 < got["cosine"] < 0.999
    for p, g in zip(branch.parameters(), before):  # the tail-only gradient is left in place
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)


def test_tasks_and_tree_advantages():
    sep, opener = opener_tokens(16)
    task = get_task("opener")
    prompt = task.make_prompt(6, 16, torch.Generator().manual_seed(0))
    assert prompt[-1] == sep and (prompt[:-1] < sep).all()
    good = torch.cat([prompt, torch.tensor([opener, opener + 1, opener + 2, opener + 3])])
    assert task.score(good, 6, 2, 16).reward == pytest.approx(1.0)
    no_opener = torch.cat([prompt, torch.tensor([3, 4, 5, 6])])
    assert task.score(no_opener, 6, 2, 16).reward == pytest.approx(0.5)
    wrap = torch.cat([prompt, torch.tensor([opener]), torch.arange(opener + 1, 15), torch.tensor([0])])
    assert task.score(wrap, 6, 2, 16).reward == pytest.approx(1.0)  # counting skips the separator
    count = get_task("count-up")
    seq = torch.tensor([4, 9, 15, 0, 1, 7])
    assert count.score(seq, 2, 1, 16).reward == pytest.approx(0.5)  # 15? no, 0 yes, 1 yes, 7 no

    # tree baseline: 1 prompt, 2 stems x 2 tails, rewards [1, 0 | 1, 1]
    seqs = [torch.full((7,), i) for i in range(4)]
    sample = TreeSample(seqs, 3, 2, 2, 1, 2, 2)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv = tree_advantages(sample, rewards, eps=0.0)
    std = rewards.std()
    # entries 2, 3 predict the stem tokens 3, 4; entries 4, 5 the tail tokens 5, 6
    assert torch.allclose(adv[:, 2], torch.tensor([-0.25, -0.25, 0.25, 0.25]) / std)
    assert torch.allclose(adv[:, 4], torch.tensor([0.5, -0.5, 0.0, 0.0]) / std)
    assert torch.equal(adv[:, :2], torch.zeros(4, 2))
    pairs, groups = preference_pairs(sample, torch.tensor([0.0, 1.0, 0.5, 0.5]))
    assert [int(p[0]) for p in pairs] == [1, 0] and groups == [0, 0]  # chosen first; the tie is dropped


def test_naive_micro_batches_keep_pairs_and_equal_one_batch(model_pair):
    """Naive micro-batches (gradient accumulation, whole DPO pairs) give the one-batch
    log-probs and gradient; a bad size is refused."""
    from megatron_branch.commands.study.algos import Prepared

    torch.manual_seed(0)
    seqs = [torch.randint(0, 32, (n,)) for n in (9, 7, 11, 6, 8)]
    prep = Prepared(seqs, torch.ones(5, 10), lambda _: None, group_ids=[0, 0, 1, 1, 2])
    assert [b.tolist() for b in study_run._naive_micro_batches(prep, 1)] == [[0, 1], [2, 3], [4]]
    assert [b.tolist() for b in study_run._naive_micro_batches(prep, 4)] == [[0, 1, 2, 3], [4]]
    model = model_pair[0]
    weights = torch.randn(5, 10)

    def loss_fn(lp, ids):
        return (lp * weights[ids]).sum()

    results = []
    for size in (None, 1, 2):
        model.zero_grad()
        mode = study_run.MODES["naive"]
        loss, _, _ = study_run._backward(mode, model, prep, None, loss_fn, None, size)
        results.append((loss, grads(model)))
    for loss, g in results[1:]:
        assert abs(loss - results[0][0]) <= 1e-5 * abs(results[0][0])
        assert max(compare_grads(g, results[0][1]).values()) <= 1e-5
    with pytest.raises(ValueError, match="naive_micro_batch"):
        StudyConfig(naive_micro_batch=0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(modes=["fast"]), "modes"),
    (dict(experiments=["grpo"]), "experiments"),
    (dict(experiments=["grpo:chess"]), "experiments"),
    (dict(steps=0), "steps"),
    (dict(prompt_len=1), "prompt_len"),
    (dict(chunk_tokens=3), "chunk_tokens"),
    (dict(seeds=[]), "seeds"),
    (dict(threads=0), "threads"),
    (dict(naive_micro_batch=0), "naive_micro_batch"),
])
def test_bad_study_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StudyConfig(**kwargs)
