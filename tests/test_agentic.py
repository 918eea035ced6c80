"""Multi-turn agentic rollouts: loss masks carried with the tree, per-turn advantages,
exact against naive, and the example's tree and naive updates agree."""

import importlib.util
import os

import pytest
import torch
from conftest import VOCAB, make_pair

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch.agentic import Turn, assemble, group_turn_advantages
from megatron_branch.reference.agreement import compare_grads, grads
from megatron_branch.reference.naive import naive_rollout_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def two_turn_rollouts():
    prompt = Turn(list(range(1, 20)), "prompt")
    calls = [Turn([30, 31, 32], "policy"), Turn([30, 31, 40], "policy")]
    out = []
    for call in calls:
        for result in ([50, 51], [50, 52]):
            for answer in ([60 + result[1] % 7, 61], [62, 63, 64]):
                out.append([prompt, call, Turn(result, "tool"), Turn(answer, "policy")])
    return out


def test_loss_masks_travel_with_the_tree():
    batch = assemble(two_turn_rollouts())
    tree = batch.tree(vocab_size=VOCAB)
    mask = tree.rollout_loss_mask()
    for r, (seq, m) in enumerate(zip(batch.sequences, batch.loss_masks)):
        assert torch.equal(mask[r, : seq.numel() - 1].bool(), m[1:])
    assert tree.loss_mask.sum() < tree.unique_positions / 2  # prompt and tool tokens are context
    adv = batch.token_advantages(torch.arange(8 * 4, dtype=torch.float).view(8, 4))
    assert adv[0, 18].item() == 1 and adv[0, 21].item() == 2 and adv[0, 23].item() == 3  # call, tool, answer


def test_agentic_branch_replay_is_exact_against_naive():
    branch, stock = make_pair()
    batch = assemble(two_turn_rollouts())
    tree = batch.tree()
    mask = tree.rollout_loss_mask()
    rewards = torch.rand(8, 4, generator=torch.Generator().manual_seed(0))
    adv = batch.token_advantages(group_turn_advantages(rewards, 8))
    old = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))
    tokens = mask.sum()

    def loss_fn(lp, ids):
        return losses.ppo_policy_loss(lp, old[ids], adv[ids], mask[ids], global_tokens=tokens)[0]

    stats = mb.replay_step(branch, tree, loss_fn, max_chunk_tokens=12, score_mask=mask)
    naive = loss_fn(naive_rollout_logprobs(stock, batch.sequences), torch.arange(8))
    naive.backward()
    assert abs(stats.loss - naive.item()) < 1e-6
    diffs = compare_grads(grads(branch), grads(stock))
    assert max(diffs.values()) < 1e-5, max(diffs, key=diffs.get)


def test_bad_agentic_input_names_the_rollout_and_position():
    with pytest.raises(ValueError, match="rollout 1, turn 2: the turn is empty"):
        assemble([[Turn([1, 2], "prompt"), Turn([3], "policy")],
                  [Turn([1, 2], "prompt"), Turn([3], "policy"), Turn([], "tool")]])
    with pytest.raises(ValueError, match="rollout 0, turn 0: a rollout cannot start with policy output"):
        assemble([[Turn([1], "policy")]])
    with pytest.raises(ValueError, match="rollout 0, turn 1: role 'user' is not one of"):
        assemble([[Turn([1], "prompt"), Turn([2], "user")]])
    with pytest.raises(ValueError, match="rollout 0: has no turns"):
        assemble([[]])
    seqs = [[1, 2, 3, 4], [1, 2, 5]]
    with pytest.raises(ValueError, match="rollout 1: loss_masks has 2 entries for 3 tokens"):
        mb.BranchTree.from_sequences(seqs, loss_masks=[[0, 0, 1, 1], [0, 1]])
    with pytest.raises(ValueError, match="rollout 1: loss_masks position 1 is 0 but rollout 0 marks the same "
                                         "shared token 1"):
        mb.BranchTree.from_sequences(seqs, loss_masks=[[0, 1, 1, 1], [0, 0, 1]])
    with pytest.raises(ValueError, match="rollout 0: loss_masks position 2 is 2, not 0 or 1"):
        mb.BranchTree.from_sequences(seqs, loss_masks=[[0, 0, 2, 1], [0, 0, 1]])
    with pytest.raises(ValueError, match="loss_masks: 1 masks for 2 rollouts"):
        mb.BranchTree.from_sequences(seqs, loss_masks=[[0, 0, 1, 1]])
    with pytest.raises(ValueError, match="built without loss masks"):
        mb.BranchTree.from_sequences(seqs).rollout_loss_mask()
    with pytest.raises(ValueError, match=r"turn_advantages: expected \[8, >= 4\]"):
        assemble(two_turn_rollouts()).token_advantages(torch.zeros(8, 2))


def test_agentic_example_tree_and_naive_updates_agree():
    spec = importlib.util.spec_from_file_location("agentic", os.path.join(ROOT, "examples", "agentic_tool_grpo.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tree = example.train(example.parse_args(["--steps", "3"]), echo=lambda *_: None)
    naive = example.train(example.parse_args(["--steps", "3", "--naive"]), echo=lambda *_: None)
    for a, b in zip(tree, naive):
        assert a["reward"] == b["reward"]  # the same samples: the policies stayed identical
        assert abs(a["loss"] - b["loss"]) < 1e-6
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"]
    assert tree[0]["segments"] > 40 and tree[0]["naive_positions"] > 2 * tree[0]["unique_positions"]
