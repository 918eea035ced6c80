"""The verl 0.9.1 engine adapter against verl's own stock Megatron forward, on the CPU.

verl's ``MegatronEngineWithLMHead.forward_step`` (its ``gptmodel_forward_model_engine`` and
logits processor) on the branch-spec model without tree data — the stock THD semantics —
is the reference; ``BranchMegatronEngine`` runs branch replay on the same model and
micro-batch. Log-probs, entropy and verl's ``ppo_loss`` gradients agree within 1e-5 (fp32).
Runs in the ``[verl]`` venv of ``.ci/run``; skipped where verl is not installed.
"""

import types
from functools import partial

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]': its own venv in .ci/run)")

from tensordict.tensorclass import NonTensorData, NonTensorStack  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import McoreActorConfig, McoreEngineConfig  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from megatron_branch.cpu import cuda_factories_on_cpu  # noqa: E402
from megatron_branch.integrations.options import BranchOptions  # noqa: E402
from megatron_branch.integrations.verl import (  # noqa: E402
    BranchMegatronEngine,
    branch_layer_spec,
    check_config,
    check_micro_batch,
    pack_groups,
    split_to,
)
from megatron_branch.integrations.verl import engine as engine_module  # noqa: E402
from megatron_branch.reference.agreement import compare_grads  # noqa: E402
from megatron_branch.spec.builders import build_gpt, llama_config  # noqa: E402
from megatron_branch.training import ExactnessCheck  # noqa: E402

VOCAB = 64
TOL = 1e-5


def engine(cls, model):
    """The engine object as verl's forward_step and forward_backward_batch read it (its
    ``initialize`` needs Megatron-Bridge and CUDA)."""
    eng = object.__new__(cls)
    eng.engine_config = McoreEngineConfig()
    eng.model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=["LlamaForCausalLM"]),
        tokenizer=types.SimpleNamespace(pad_token_id=0),
        mtp=types.SimpleNamespace(enable=False, enable_train=False), model_type="language_model")
    eng.enable_routing_replay = False
    eng.tf_config = None
    eng.module = [model]
    return eng


def models():
    cfg = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2)
    a = build_gpt(cfg, VOCAB, seed=0)
    b = build_gpt(cfg, VOCAB, seed=0)
    b.load_state_dict(a.state_dict())
    return a, b


def grpo_batch(temperature=0.7, seed=1):
    """Two GRPO groups (uid a, b) of prompt + response, verl's no-padding micro-batch layout."""
    g = torch.Generator().manual_seed(seed)
    prompts = {"a": torch.randint(1, VOCAB, (9,), generator=g), "b": torch.randint(1, VOCAB, (6,), generator=g)}
    uids, plist, rlist = ["a", "a", "a", "b", "b"], [], []
    for u, r in zip(uids, [4, 3, 5, 2, 4]):
        plist.append(prompts[u])
        rlist.append(torch.randint(1, VOCAB, (r,), generator=g))
    nest = lambda tensors: torch.nested.as_nested_tensor(tensors, layout=torch.jagged)  # noqa: E731
    b, pm, rm = len(uids), max(len(p) for p in plist), max(len(r) for r in rlist)
    prompt_d, resp_d = torch.zeros(b, pm, dtype=torch.long), torch.zeros(b, rm, dtype=torch.long)
    attn, resp_mask = torch.zeros(b, pm + rm, dtype=torch.long), torch.zeros(b, rm, dtype=torch.long)
    for i, (p, r) in enumerate(zip(plist, rlist)):
        prompt_d[i, pm - len(p):] = p
        attn[i, pm - len(p): pm] = 1
        resp_d[i, : len(r)] = r
        attn[i, pm: pm + len(r)] = 1
        resp_mask[i, : len(r)] = 1
    td = tu.get_tensordict(
        tensor_dict={"input_ids": nest([torch.cat([p, r]) for p, r in zip(plist, rlist)]), "prompts": prompt_d,
                     "responses": resp_d, "attention_mask": attn, "response_mask": resp_mask, "loss_mask": resp_mask,
                     "old_log_probs": torch.full((b, rm), -3.0),
                     "advantages": torch.linspace(-1, 1, b)[:, None].expand(b, rm).clone()},
        non_tensor_dict={"temperature": temperature, "calculate_entropy": True, "use_dynamic_bsz": True,
                         "max_token_len_per_gpu": 32, "global_batch_size": b, "max_response_len": rm,
                         "num_micro_batch": 1})
    td["uid"] = NonTensorStack.from_list([NonTensorData(u) for u in uids])
    return td


def forward(eng, model, td):
    post = partial(eng.postprocess_micro_batch_func, forward_only=True, loss_function=None)
    out, post_fn = eng.forward_step(iter([td]), model, logits_processor_func=None, postprocess_micro_batch_func=post)
    return post_fn(out)[1]["model_output"]


def test_verl_selects_the_engine_by_vendor(monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "branch")
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is BranchMegatronEngine
    monkeypatch.delenv("VERL_ENGINE_VENDOR")
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is MegatronEngineWithLMHead


def test_forward_step_matches_verls_stock_forward():
    a, b = models()
    td = grpo_batch()
    with torch.no_grad():
        stock = forward(engine(MegatronEngineWithLMHead, a), a, td)
        ours = forward(engine(BranchMegatronEngine, b), b, td)
    # the last position predicts past the sequence: verl's log-prob there scores the next packed
    # sequence's first token, its entropy is of that prediction; ppo_loss reads neither, ours are 0
    for key in ("log_probs", "entropy"):
        for i, (s, o) in enumerate(zip(stock[key].unbind(), ours[key].unbind())):
            assert s.shape == o.shape, (key, i)
            assert (s[:-1] - o[:-1]).abs().max() < TOL, (key, i)
            assert float(o[-1]) == 0.0


def test_ppo_loss_gradients_match_verls_stock_engine():
    a, b = models()
    cfg = McoreActorConfig(rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=5)
    loss_fn = partial(ppo_loss, config=cfg)
    outs = []
    for cls, model in ((MegatronEngineWithLMHead, a), (BranchMegatronEngine, b)):
        model.train()
        with cuda_factories_on_cpu():
            outs.append(engine(cls, model).forward_backward_batch(grpo_batch(), loss_function=loss_fn))
    diffs = compare_grads({n: p.grad for n, p in b.named_parameters()}, {n: p.grad for n, p in a.named_parameters()})
    assert max(diffs.values()) < TOL, max(diffs, key=diffs.get)
    # forward-only (old log-probs) comes back in verl's order
    with torch.no_grad(), cuda_factories_on_cpu():
        stock = engine(MegatronEngineWithLMHead, a).forward_backward_batch(grpo_batch(), None, forward_only=True)
        ours = engine(BranchMegatronEngine, b).forward_backward_batch(grpo_batch(), None, forward_only=True)
    for s, o in zip(stock["model_output"]["log_probs"].unbind(), ours["model_output"]["log_probs"].unbind()):
        assert (s[:-1] - o[:-1]).abs().max() < TOL


def branch_config(**branch):
    """verl's engine config with megatron_branch's choices under override_mcore_model_config.branch."""
    return McoreEngineConfig(override_mcore_model_config={"branch": branch})


def test_the_engine_config_chooses_the_kernel():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = branch_layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm"), kernel="math")
    assert spec.submodules.self_attention.submodules.core_attention.params["kernel"] == "math"
    _, b = models()
    eng = engine(BranchMegatronEngine, b)
    eng.engine_config = branch_config(kernel="efficient_varlen", max_chunk_tokens=64)
    assert eng._options() == BranchOptions(kernel="efficient_varlen", max_chunk_tokens=64)


def test_forward_only_log_probs_stream_within_the_budget(monkeypatch):
    """With max_chunk_tokens, a forward-only pass without entropy (verl's ref log-probs)
    streams the tree (replay_logprobs); its log-probs are verl's stock ones. With entropy
    (verl's old log-probs) or gradients it runs one forward."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["max_chunk_tokens"])
        return replay(*args, **kwargs)

    replay = engine_module.replay_logprobs
    monkeypatch.setattr(engine_module, "replay_logprobs", spy)
    a, b = models()
    td = grpo_batch()
    tu.assign_non_tensor(td, calculate_entropy=False)
    eng = engine(BranchMegatronEngine, b)
    eng.engine_config = branch_config(max_chunk_tokens=4)
    with torch.no_grad():
        stock = forward(engine(MegatronEngineWithLMHead, a), a, td)
        ours = forward(eng, b, td)
    assert calls == [4]
    for i, (s, o) in enumerate(zip(stock["log_probs"].unbind(), ours["log_probs"].unbind())):
        assert s.shape == o.shape, i
        assert (s[:-1] - o[:-1]).abs().max() < TOL, i
        assert float(o[-1]) == 0.0
    with torch.no_grad():
        forward(eng, b, grpo_batch())  # entropy asked: one forward
    forward(eng, b, td)  # gradients: one forward
    assert calls == [4]


def test_bad_branch_options_are_refused_naming_the_key():
    _, b = models()
    for branch, key in (({"kernel": "flash"}, "branch.kernel"), ({"max_chunk_tokens": 0}, "branch.max_chunk_tokens")):
        eng = engine(BranchMegatronEngine, b)
        eng.engine_config = branch_config(**branch)
        with pytest.raises(ValueError, match=f"megatron.override_mcore_model_config.{key}"):
            eng.forward_backward_batch(grpo_batch(), None, forward_only=True)


def test_micro_batches_keep_groups_whole_and_split_only_when_needed():
    seqs = [torch.arange(10), torch.arange(12), torch.arange(5) + 50, torch.arange(6) + 50, torch.arange(8) + 90]
    uids = ["a", "a", "b", "b", "c"]
    bins = pack_groups(seqs, uids, budget=20)
    assert sorted(i for b in bins for i in b) == list(range(5))
    for b in bins:  # every group in one micro-batch
        assert all(all(j in b for j in range(5) if uids[j] == uids[i]) for i in b)
    more = split_to(bins, uids, len(bins) + 1)
    assert len(more) == len(bins) + 1 and sorted(i for b in more for i in b) == list(range(5))
    assert split_to([[0, 1]], ["a", "a"], 2) == [[0], [1]]  # one group left: cut (exact, less shared)
    with pytest.raises(ValueError, match="fewer than the 3 micro-batches"):
        split_to([[0, 1]], ["a", "a"], 3)


def test_the_run_time_check_reports_in_verls_metrics():
    _, b = models()
    eng = engine(BranchMegatronEngine, b)
    eng.verify = ExactnessCheck(every=1, rollouts=3, tolerance=1e-4)
    cfg = McoreActorConfig(rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=5)
    with cuda_factories_on_cpu():
        out = eng.forward_backward_batch(grpo_batch(), loss_function=partial(ppo_loss, config=cfg))
    assert out["metrics"]["branch/max_logprob_diff"][0] < 1e-5


def test_what_cannot_be_exact_is_refused_naming_the_option():
    model_config = types.SimpleNamespace(mtp=types.SimpleNamespace(enable=False), model_type="language_model")
    for field, value, option in (("use_fused_kernels", True, "use_fused_kernels=True"),
                                 ("use_remove_padding", False, "use_remove_padding=False"),
                                 ("dynamic_context_parallel", True, "dynamic_context_parallel=True"),
                                 ("context_parallel_size", 2, "context_parallel_size > 1"),
                                 ("pipeline_model_parallel_size", 2, "pipeline_model_parallel_size > 1")):
        config = types.SimpleNamespace(**{field: value})
        with pytest.raises(ValueError, match=option):
            check_config(config, model_config)
    with pytest.raises(ValueError, match="mtp.enable=True"):
        check_config(types.SimpleNamespace(), types.SimpleNamespace(mtp=types.SimpleNamespace(enable=True)))
    with pytest.raises(ValueError, match="critic"):
        check_config(types.SimpleNamespace(), types.SimpleNamespace(model_type="value_model"))
    td = grpo_batch()
    tu.assign_non_tensor(td, distillation_use_topk=True)
    with pytest.raises(ValueError, match="distillation_use_topk"):
        check_micro_batch(td)
    td = grpo_batch(temperature=0.0)
    _, b = models()
    with pytest.raises(ValueError, match="rollout 0: temperature must be a finite number > 0"):
        forward(engine(BranchMegatronEngine, b), b, td)
