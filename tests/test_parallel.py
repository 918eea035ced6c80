"""TP, CP, TP x CP and PP branch replay equal the single-process run (gloo, CPU).

Every rank's unsharded gradients after Megatron's ``finalize_model_grads`` (models in
Megatron's DDP) and its per-rollout log-probs are compared with one process running the
same step.
"""

import dist_worker
import pytest
import torch

import megatron_branch as mb
from megatron_branch.attention.context_parallel import shard_bounds, shard_work
from megatron_branch.distributed import free_port
from megatron_branch.full_state import full_state
from megatron_branch.reference.agreement import compare_grads
from megatron_branch.replay.plan import plan_replay

TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Weights file and single-process results for every case."""
    path = tmp_path_factory.mktemp("weights") / "full.pt"
    from megatron_branch.training import wrap_ddp

    model = dist_worker.build()
    torch.save(full_state(model, "param"), path)
    model = wrap_ddp(model)
    results = {}
    for name, (batch, tree) in dist_worker.trees().items():
        results[name] = dist_worker.run_case(model, batch, tree, None, "allgather", 1)
    return path, results


def check(ranks, reference, cases, lp=True):
    _, ref = reference
    for rank, res in enumerate(ranks):
        for name, chunk, comm in cases:
            got = res[f"{name}/{chunk}/{comm}"]
            diffs = compare_grads(got["grads"], ref[name]["grads"])
            assert max(diffs.values()) < TOL, (rank, name, chunk, comm, max(diffs, key=diffs.get))
            if lp:
                assert (got["lp"] - ref[name]["lp"]).abs().max() < TOL, (rank, name, chunk, comm)


# budget 24: stems also run complete subtrees below them (each rank caches its share of the chain only)
CP_CASES = [(n, c, m) for n in ("multi_level", "forest") for c, m in
            ((None, "allgather"), (None, "p2p"), (12, "allgather"), (12, "p2p"), (24, "p2p"))]


def test_the_budget_24_cases_run_stems_with_complete_subtrees():
    for name in ("multi_level", "forest"):
        tree = dist_worker.trees()[name][1]
        assert any(op.path_end is not None for op in plan_replay(tree, 24, attach_subtrees=True)), name


@pytest.mark.parametrize("layout, cases", [
    ({"tp": 2, "cp": 1, "pp": 1}, [("multi_level", None, "allgather"), ("forest", 12, "allgather")]),
    ({"tp": 2, "cp": 1, "pp": 1, "sp": True}, [("multi_level", None, "allgather"), ("forest", 12, "allgather")]),
    ({"tp": 1, "cp": 2, "pp": 1}, CP_CASES),
    ({"tp": 1, "cp": 4, "pp": 1}, [("multi_level", None, "allgather"), ("forest", None, "p2p"),
                                   ("multi_level", 12, "p2p")]),
    ({"tp": 2, "cp": 2, "pp": 1, "sp": True}, [("multi_level", None, "p2p"), ("forest", 12, "allgather"),
                                               ("multi_level", 24, "allgather")]),
    # the CUDA default's varlen contract (its CPU side): CP's clipped pieces and sharded path
    ({"tp": 1, "cp": 2, "pp": 1, "kernel": "flash_varlen"}, CP_CASES),
], ids=["tp2", "tp2-sp", "cp2", "cp4", "tp2-sp-cp2", "cp2-flash_varlen"])
def test_parallel_layout_matches_single_process(layout, cases, reference, tmp_path):
    ranks = dist_worker.spawn(layout, cases, str(reference[0]), str(tmp_path), free_port())
    check(ranks, reference, cases)


@pytest.mark.parametrize("kernel", [None, "flash_varlen"])
def test_pipeline_parallel_schedule_matches_single_process(kernel, reference, tmp_path):
    cases = [("multi_level", None, "allgather"), ("forest", None, "allgather")]
    layout = {"tp": 1, "cp": 1, "pp": 2, "kernel": kernel}
    ranks = dist_worker.spawn(layout, cases, str(reference[0]), str(tmp_path), free_port())
    check(ranks, reference, cases, lp=False)


def test_cp_more_ranks_than_rollouts_and_odd_lengths(reference, tmp_path):
    batch, tree = dist_worker.trees()["tiny"]
    assert tree.unique_positions % 4 != 0 and tree.num_rollouts < 4
    cases = [("tiny", None, "allgather"), ("tiny", None, "p2p"), ("tiny", 4, "allgather")]
    ranks = dist_worker.spawn({"tp": 1, "cp": 4, "pp": 1}, cases, str(reference[0]), str(tmp_path), free_port())
    check(ranks, reference, cases)


def test_balance_of_a_long_prompt_with_many_tails():
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (4096,), generator=gen)
    seqs = []
    for i in range(16):
        tail = torch.randint(0, 1000, (256,), generator=gen)
        tail[0] = 1000 + i
        seqs.append(torch.cat([prompt, tail]))
    tree = mb.BranchTree.from_sequences(seqs)
    bounds = shard_bounds(tree.positions, 4)
    pairs = shard_work(tree.positions, bounds)["attention_pairs"]
    assert sum(pairs) == tree.attention_pairs()
    assert max(pairs) / (sum(pairs) / 4) <= 1.10
    # a token-count split would be far off
    naive = [(i * tree.unique_positions // 4, (i + 1) * tree.unique_positions // 4) for i in range(4)]
    npairs = shard_work(tree.positions, naive)["attention_pairs"]
    assert max(npairs) / (sum(npairs) / 4) > 1.3


def test_shard_bounds_edge_cases():
    pos = torch.arange(10)
    b = shard_bounds(pos, 4, multiple=2)
    assert b[0][0] == 0 and b[-1][1] == 10 and all(e > s for s, e in b)
    assert all(s % 2 == 0 for s, _ in b)
    with pytest.raises(ValueError, match="cp_size"):
        shard_bounds(pos, 0)
