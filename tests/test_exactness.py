"""Branch replay vs the naive computation (stock Megatron spec, each rollout alone).

Log-probs within 1e-5 and every parameter gradient within 1e-5 relative, fp32, for a
GRPO loss with per-rollout advantages.
"""

import pytest
import torch
from conftest import VOCAB, make_pair, rand_seq

import megatron_branch as mb
from megatron_branch import losses
from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.reference.agreement import check_against_naive
from megatron_branch.reference.naive import batched_rollout_logprobs, naive_rollout_logprobs
from megatron_branch.scoring.logprobs import per_rollout, unique_token_logprobs

LP_TOL = 1e-5
GRAD_TOL = 1e-5


def one_prompt_8_rollouts():
    return branching_rollouts([40], [8], [12], VOCAB, seed=1, jitter=4)


def multi_level():
    # a shared response stem that forks, and forks again
    return branching_rollouts([24], [2, 2, 3], [6, 5, 7], VOCAB, seed=2)


def forest_3_prompts():
    return branching_rollouts([30, 17, 45], [3], [9], VOCAB, seed=3, jitter=5)


def identical_and_prefix():
    gen = torch.Generator().manual_seed(4)
    base = rand_seq(gen, 30)
    seqs = [base, base.clone(), base[:20], torch.cat([base, rand_seq(gen, 6)]), base[:1], base[:2]]
    return losses_batch(seqs, [1, 1, 1, 1, 0, 1])


def losses_batch(seqs, prompt_lengths):
    from megatron_branch.commands.synthetic import RolloutBatch

    return RolloutBatch(list(seqs), list(prompt_lengths), [0] * len(seqs))


TREES = {
    "one_prompt_8_rollouts": one_prompt_8_rollouts,
    "multi_level": multi_level,
    "forest_3_prompts": forest_3_prompts,
    "identical_and_prefix": identical_and_prefix,
}


def grpo_loss_fn(batch):
    num = len(batch.sequences)
    adv = torch.linspace(-1.0, 1.5, num)
    lengths = torch.tensor(batch.lengths)
    prompts = torch.tensor(batch.prompt_lengths).clamp(min=1)
    mask = torch.zeros(num, int(lengths.max()) - 1)
    for r in range(num):
        mask[r, prompts[r] - 1 : lengths[r] - 1] = 1.0
    old = None

    def loss_fn(lp):
        nonlocal old
        if old is None:  # same behaviour log-probs for both runs
            old = lp.detach() + 0.05 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(0))
        loss, _ = losses.ppo_policy_loss(lp, old, adv, mask, clip_ratio=0.2, dual_clip=3.0)
        return loss

    return loss_fn


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("backend", ["cascade", "dense", "repeat_kv"])
def test_logprobs_loss_and_every_gradient_match_naive(tree_name, backend):
    batch = TREES[tree_name]()
    branch, stock = make_pair(backend=backend)
    report = check_against_naive(branch, stock, batch.sequences, grpo_loss_fn(batch))
    assert report.max_abs_logprob_diff < LP_TOL
    assert report.loss_rel_diff < LP_TOL
    assert report.max_rel_grad_diff < GRAD_TOL, (report.worst_param, report.max_rel_grad_diff)
    assert len(report.grad_rel_diffs) == len(list(stock.parameters()))


@pytest.mark.parametrize("chunk_size, kernel", [(5, "flash_cpu"), (7, "math"), (None, "math"), (None, "flash_varlen")])
def test_cascade_chunking_and_kernels_match_naive(chunk_size, kernel):
    batch = multi_level()
    branch, stock = make_pair(chunk_size=chunk_size, kernel=kernel)
    report = check_against_naive(branch, stock, batch.sequences, grpo_loss_fn(batch))
    assert report.max_abs_logprob_diff < LP_TOL
    assert report.max_rel_grad_diff < GRAD_TOL


def test_qk_layernorm_mha_and_tied_embeddings():
    batch = forest_3_prompts()
    from megatron_branch.spec.builders import build_gpt, llama_config

    config = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                          qk_layernorm=True)
    branch = build_gpt(config, VOCAB, seed=5, share_embeddings_and_output_weights=True)
    stock = build_gpt(config, VOCAB, branch=False, share_embeddings_and_output_weights=True)
    stock.load_state_dict(branch.state_dict())
    report = check_against_naive(branch, stock, batch.sequences, grpo_loss_fn(batch))
    assert report.max_abs_logprob_diff < LP_TOL
    assert report.max_rel_grad_diff < GRAD_TOL


def logprobs_at_packed_index(branch, tree):
    """Per-rollout log-probs with RoPE at each token's packed index instead of its depth:
    what a tree model that ignored the tree's positions would compute."""
    params = mb.BranchPackedSeqParams.from_tree(tree)
    params.positions = torch.arange(tree.unique_positions)
    params.max_seqlen_q = params.max_seqlen_kv = tree.unique_positions
    with torch.no_grad():
        logits = branch(tree.tokens[None], tree.positions[None], attention_mask=None, packed_seq_params=params)
        return per_rollout(unique_token_logprobs(logits[0], tree)[0], tree)


def test_positions_matter():
    # Guard against a test that cannot fail: RoPE at packed index instead of depth differs.
    batch = one_prompt_8_rollouts()
    branch, stock = make_pair()
    lp_wrong = logprobs_at_packed_index(branch, mb.BranchTree.from_sequences(batch.sequences))
    with torch.no_grad():
        ref = naive_rollout_logprobs(stock, batch.sequences)
    assert (lp_wrong - ref).abs().max() > 1e-3


def test_entropy_and_its_gradient_match_naive_softmax_entropy():
    batch = forest_3_prompts()
    branch, stock = make_pair()
    tree = mb.BranchTree.from_sequences(batch.sequences)
    lp, ent = mb.rollout_logprobs(branch, tree, entropy=True)
    (ent.sum() + lp.sum()).backward()
    total = 0.0
    for r, seq in enumerate(batch.sequences):
        n = seq.numel()
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
        logits = stock(seq[None], torch.arange(n)[None], attention_mask=mask)[0, :-1].float()
        ref = torch.distributions.Categorical(logits=logits).entropy()
        assert (ent[r, : n - 1].detach() - ref.detach()).abs().max() < 1e-5
        assert (ent[r, n - 1 :] == 0).all()
        ref_lp = torch.log_softmax(logits, -1).gather(-1, seq[1:, None])[:, 0]
        total = total + ref.sum() + ref_lp.sum()
    total.backward()
    from megatron_branch.reference.agreement import compare_grads, grads

    assert max(compare_grads(grads(branch), grads(stock)).values()) < GRAD_TOL


def test_branch_spec_without_a_tree_is_plain_causal_attention():
    batch = forest_3_prompts()
    branch, stock = make_pair()
    with torch.no_grad():
        got = batched_rollout_logprobs(branch, batch.sequences)
        ref = naive_rollout_logprobs(stock, batch.sequences)
    assert (got - ref).abs().max() < LP_TOL


def test_model_without_branch_spec_is_rejected(model_pair):
    _, stock = model_pair
    tree = mb.BranchTree.from_sequences([[1, 2, 3], [1, 2, 4]])
    with pytest.raises(ValueError, match="get_branch_layer_spec"):
        mb.rollout_logprobs(stock, tree)


def test_token_outside_model_vocabulary_is_rejected(model_pair):
    branch, _ = model_pair
    tree = mb.BranchTree.from_sequences([[1, 2, 3], [1, 2, VOCAB + 3]])
    with pytest.raises(ValueError, match=f"rollout 1: tokens contains id {VOCAB + 3} outside the vocabulary"):
        mb.rollout_logprobs(branch, tree)
