"""The engine as verl builds it: ``EngineRegistry`` with ``VERL_ENGINE_VENDOR=branch``, then
``initialize()`` on the CPU (gloo) through verl's vanilla ``mbridge`` path, from a tiny Llama
checkpoint on disk.

The reference is verl's stock ``MegatronEngineWithLMHead``, selected by the same registry
without the vendor and initialized the same way, on the same checkpoint: log-probs, entropy and
``ppo_loss`` gradients agree within 1e-5 (fp32). Also: the ``branch/*`` metrics, the warning
when groups arrive split, the token budget, refusals at ``initialize()``, and two processes
(data parallel, tensor parallel). Runs in the ``[verl]`` venv of ``.ci/run``.
"""

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]': its own venv in .ci/run)")
pytest.importorskip("mbridge", reason="mbridge is not installed (pip install -e '.[verl]')")

from tensordict.tensorclass import NonTensorData, NonTensorStack  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

from megatron_branch.cpu import cuda_factories_on_cpu, enable_cpu  # noqa: E402
from megatron_branch.tree import BranchTree  # noqa: E402

VOCAB = 64
TOL = 1e-5
HERE = os.path.abspath(__file__)


# ---------------------------------------------------------------------------- the checkpoint
def write_checkpoint(path: str, seed: int = 0) -> str:
    """A tiny Llama checkpoint with a tokenizer, as ``actor_rollout_ref.model.path`` points to."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")), pad_token="t0",
                            unk_token="t1", eos_token="t2", bos_token="t3").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint():
    with tempfile.TemporaryDirectory() as path:
        yield write_checkpoint(path)


# ---------------------------------------------------------------------------- verl's engines
def cpu_shims(monkeypatch=None):
    """What verl's Megatron engine needs on a machine without CUDA, beyond megatron_branch.enable_cpu:
    its memory log asks CUDA for free memory; on CPU mbridge's stock spec (Transformer Engine's)
    does not build, so verl's stock engine builds on the local spec, with the branch layers
    (no tree data: stock THD semantics; Megatron's local DotProductAttention refuses THD)."""
    from verl.workers.engine.megatron import transformer_impl
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from megatron_branch.integrations.verl.bridges import branch_layer_spec, use_mbridge_local_spec

    original = MegatronEngineWithLMHead._build_tf_config

    def stock_build(self):
        original(self)
        if type(self) is MegatronEngineWithLMHead:
            use_mbridge_local_spec(self.bridge, transform=branch_layer_spec)

    setattr_ = monkeypatch.setattr if monkeypatch is not None else setattr
    setattr_(transformer_impl, "log_gpu_memory_usage", lambda *args, **kwargs: None)
    setattr_(MegatronEngineWithLMHead, "_build_tf_config", stock_build)


def new_engine(path: str, vendor, dtype: str = "float32", **engine_kwargs):
    """``EngineRegistry.new`` as verl's ``TrainingWorker`` calls it, then ``initialize()``.

    ``dtype``: verl's config admits bf16/fp16 only; the comparisons at 1e-5 need fp32, so the
    field is set after verl's check (mbridge and Megatron take fp32 as they take bf16).
    """
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine.base import EngineRegistry

    if vendor:
        os.environ["VERL_ENGINE_VENDOR"] = vendor
    else:
        os.environ.pop("VERL_ENGINE_VENDOR", None)
    engine_kwargs.setdefault("use_distributed_optimizer", False)
    engine_config = McoreEngineConfig(vanilla_mbridge=True, use_remove_padding=True, **engine_kwargs)
    object.__setattr__(engine_config, "dtype", dtype)
    engine = EngineRegistry.new(model_type="language_model", backend="megatron", model_config=HFModelConfig(path=path),
                                engine_config=engine_config,
                                optimizer_config=McoreOptimizerConfig(lr=1e-3, total_training_steps=10),
                                checkpoint_config=CheckpointConfig())
    with cuda_factories_on_cpu():
        engine.initialize()
    return engine


@pytest.fixture
def engines(checkpoint, monkeypatch):
    """(verl's stock engine, the branch engine), both through the registry and initialize()."""
    cpu_shims(monkeypatch)
    monkeypatch.delenv("VERL_ENGINE_VENDOR", raising=False)
    stock = new_engine(checkpoint, None)
    ours = new_engine(checkpoint, "branch")
    yield stock, ours
    os.environ.pop("VERL_ENGINE_VENDOR", None)


# ---------------------------------------------------------------------------- batches
def grpo_batch(groups=(("a", 9, (4, 3, 5)), ("b", 6, (2, 4))), temperature=0.7, seed=1, uid=True,
               max_token_len=32):
    """GRPO groups (uid, prompt length, response lengths) in verl's no-padding layout."""
    g = torch.Generator().manual_seed(seed)
    uids, plist, rlist = [], [], []
    for u, plen, resps in groups:
        prompt = torch.randint(1, VOCAB, (plen,), generator=g)
        for r in resps:
            uids.append(u)
            plist.append(prompt)
            rlist.append(torch.randint(1, VOCAB, (r,), generator=g))
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
        tensor_dict={"input_ids": torch.nested.as_nested_tensor([torch.cat([p, r]) for p, r in zip(plist, rlist)],
                                                                 layout=torch.jagged),
                     "prompts": prompt_d, "responses": resp_d, "attention_mask": attn, "response_mask": resp_mask,
                     "loss_mask": resp_mask, "old_log_probs": torch.full((b, rm), -3.0),
                     "advantages": torch.linspace(-1, 1, b)[:, None].expand(b, rm).clone()},
        non_tensor_dict={"temperature": temperature, "calculate_entropy": True, "use_dynamic_bsz": True,
                         "max_token_len_per_gpu": max_token_len, "global_batch_size": b, "max_response_len": rm,
                         "num_micro_batch": 1})
    if uid:
        td["uid"] = NonTensorStack.from_list([NonTensorData(u) for u in uids])
    return td


def ppo_loss_fn():
    from verl.workers.config import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    return partial(ppo_loss, config=McoreActorConfig(rollout_n=1, ppo_micro_batch_size_per_gpu=2,
                                                     ppo_mini_batch_size=5))


def train_step(engine, batch):
    with cuda_factories_on_cpu():
        engine.optimizer_zero_grad()
        return engine.forward_backward_batch(batch, loss_function=ppo_loss_fn())


def grads(engine):
    return {n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).detach().clone()
            for n, p in engine.module[0].named_parameters()}


def max_grad_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def metric(output, name):
    return output["metrics"][name][0]


# ---------------------------------------------------------------------------- tests
def test_the_registry_builds_and_initializes_the_branch_engine(engines, caplog):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from megatron_branch.integrations.verl import BranchMegatronEngine
    from megatron_branch.spec.core_attention import BranchCoreAttention

    stock, ours = engines
    assert type(stock) is MegatronEngineWithLMHead and type(ours) is BranchMegatronEngine
    cores = [m for m in ours.module[0].modules() if isinstance(m, BranchCoreAttention)]
    assert len(cores) == 2  # one per layer of the checkpoint
    assert ours.optimizer is not None  # the training engine: DDP, optimizer, scheduler built by verl
    with caplog.at_level(logging.WARNING, logger="megatron_branch.integrations.verl.engine"):
        with cuda_factories_on_cpu():
            ours.initialize()
    assert "branch replay is active" in caplog.text


def test_the_checkpoint_is_loaded_as_hugging_face_computes_it(engines, checkpoint):
    """mbridge loads the HF weights into the branch model: log-probs equal transformers' own."""
    from transformers import LlamaForCausalLM

    _, ours = engines
    td = grpo_batch(temperature=1.0)
    tu.assign_non_tensor(td, calculate_entropy=False)
    with torch.no_grad(), cuda_factories_on_cpu():
        out = ours.forward_backward_batch(td, None, forward_only=True)
    hf = LlamaForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    for seq, lp in zip(td["input_ids"].unbind(), out["model_output"]["log_probs"].unbind()):
        with torch.no_grad():
            ref = torch.log_softmax(hf(seq[None]).logits[0].float(), -1)[:-1].gather(-1, seq[1:, None])[:, 0]
        assert (ref - lp[:-1]).abs().max() < 1e-4


def test_log_probs_entropy_and_ppo_gradients_match_verls_stock_engine(engines):
    stock, ours = engines
    outs = [train_step(engine, grpo_batch()) for engine in (stock, ours)]
    assert max_grad_diff(grads(stock), grads(ours)) < TOL
    assert float(outs[1]["metrics"]["branch/share_ratio"][0]) > 0
    with torch.no_grad(), cuda_factories_on_cpu():
        ref, got = (e.forward_backward_batch(grpo_batch(), None, forward_only=True) for e in (stock, ours))
    for key in ("log_probs", "entropy"):
        for s, o in zip(ref["model_output"][key].unbind(), got["model_output"][key].unbind()):
            # the last position predicts past the sequence; verl's loss never reads it
            assert s.shape == o.shape and (s[:-1] - o[:-1]).abs().max() < TOL


def test_every_step_reports_what_it_shared(engines):
    _, ours = engines
    td = grpo_batch()
    out = train_step(ours, td)
    sequences = list(td["input_ids"].unbind())
    naive = sum(len(s) for s in sequences)
    unique = sum(BranchTree.from_sequences([sequences[i] for i in g]).unique_positions for g in ([0, 1, 2], [3, 4]))
    assert metric(out, "branch/naive_tokens") == naive
    assert metric(out, "branch/unique_tokens") == unique  # both groups fit one micro-batch each
    assert metric(out, "branch/share_ratio") == pytest.approx(1 - unique / naive)
    assert metric(out, "branch/split_groups") == 0
    with torch.no_grad(), cuda_factories_on_cpu():  # forward-only passes (old/ref log-probs) report too
        out = ours.forward_backward_batch(grpo_batch(), None, forward_only=True)
    assert metric(out, "branch/unique_tokens") == unique


def test_a_batch_without_uid_is_one_group_per_rollout(engines):
    """No ``uid``: every rollout is its own group; with distinct prompts nothing is shared."""
    stock, ours = engines
    groups = (("a", 7, (3,)), ("b", 5, (4,)), ("c", 6, (2,)))
    outs = [train_step(engine, grpo_batch(groups=groups, uid=False)) for engine in (stock, ours)]
    assert max_grad_diff(grads(stock), grads(ours)) < TOL
    assert metric(outs[1], "branch/share_ratio") == 0.0
    assert metric(outs[1], "branch/split_groups") == 0
    assert metric(outs[1], "branch/naive_tokens") == metric(outs[1], "branch/unique_tokens") == 27


def test_a_group_larger_than_the_budget_is_cut_exactly_and_warned(engines, caplog, monkeypatch):
    """Budget 18 unique tokens, a group whose tree has 21: cut at rollout boundaries (each part
    recomputes the prompt), no micro-batch above the budget, gradients still verl's."""
    from megatron_branch.integrations.verl import BranchMegatronEngine

    stock, ours = engines
    computed = []
    forward_step = BranchMegatronEngine.forward_step

    def counted(self, batch_iter, *args, **kwargs):
        batch = next(batch_iter)
        computed.append(BranchTree.from_sequences(list(batch["input_ids"].unbind())).unique_positions)
        return forward_step(self, iter([batch]), *args, **kwargs)

    monkeypatch.setattr(BranchMegatronEngine, "forward_step", counted)
    groups = (("a", 9, (4, 3, 5)),)
    train_step(stock, grpo_batch(groups=groups, max_token_len=18))
    with caplog.at_level(logging.WARNING, logger="megatron_branch.integrations.verl.engine"):
        out = train_step(ours, grpo_batch(groups=groups, max_token_len=18))
    assert len(computed) >= 2 and max(computed) <= 18
    assert max_grad_diff(grads(stock), grads(ours)) < TOL
    assert metric(out, "branch/split_groups") == 1
    assert metric(out, "branch/unique_tokens") == sum(computed)
    assert "arrived split" in caplog.text and "max_token_len_per_gpu" in caplog.text


def test_the_measured_case_keeps_its_budget():
    """The case that broke it: one group of 1,100 unique tokens under a budget of 512."""
    from megatron_branch.integrations.verl import pack_groups, split_to

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, VOCAB, (300,), generator=g)
    seqs = [torch.cat([prompt, torch.tensor([i + 1]), torch.randint(1, VOCAB, (99,), generator=g)]) for i in range(8)]
    uids = ["a"] * 8
    assert BranchTree.from_sequences(seqs).unique_positions == 1100
    bins = pack_groups(seqs, uids, budget=512)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert max(BranchTree.from_sequences([seqs[i] for i in b]).unique_positions for b in bins) <= 512
    assert len(bins) == 4  # 300 + 2 x 100 per part: the fewest parts at rollout boundaries
    more = split_to(bins, uids, 6)  # another DP rank needs 6 micro-batches: still within the budget
    assert len(more) == 6 and sorted(i for b in more for i in b) == list(range(8))
    with pytest.raises(ValueError, match="max_token_len_per_gpu: a rollout of 400 tokens"):
        pack_groups(seqs, uids, budget=399)


def test_what_cannot_be_exact_is_refused_at_initialize(checkpoint, monkeypatch):
    cpu_shims(monkeypatch)
    for kwargs, option in (({"use_fused_kernels": True}, "use_fused_kernels=True"),
                           ({"pad_to_length": True}, "pad_to_length=True"),
                           ({"context_parallel_size": 2}, "megatron.context_parallel_size > 1"),
                           ({"pipeline_model_parallel_size": 2}, "megatron.pipeline_model_parallel_size > 1"),
                           ({"override_mcore_model_config": {"branch": {"kernel": "nope"}}},
                            "override_mcore_model_config.branch.kernel")):
        built = []
        monkeypatch.setattr("verl.workers.engine.megatron.transformer_impl.MegatronEngine._build_megatron_module",
                            lambda self: built.append(1))
        with pytest.raises(ValueError, match=option):
            new_engine(checkpoint, "branch", **kwargs)
        assert not built  # refused before verl builds anything
    os.environ.pop("VERL_ENGINE_VENDOR", None)


@dataclass
class Provider:
    """The two fields of a Megatron-Bridge ``GPTModelProvider`` the hook reads and writes."""

    attention_backend: Any
    transformer_layer_spec: Any


def test_a_spec_hook_that_would_mix_stock_attention_is_refused():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend

    from megatron_branch.integrations.verl import branch_layer_spec, check_branch_model, hook_provider
    from megatron_branch.spec.builders import llama_config

    def builder(config, vp_stage=None):
        return get_gpt_layer_local_spec(normalization="RMSNorm")

    with pytest.raises(ValueError, match="megatron.override_transformer_config.attention_backend=local"):
        hook_provider(Provider(AttnBackend.local, builder))
    provider = Provider(AttnBackend.flash, builder)
    hook_provider(provider, kernel="math")
    spec = provider.transformer_layer_spec(provider, vp_stage=None)
    assert spec.submodules.self_attention.submodules.core_attention.params["kernel"] == "math"
    # what Megatron-Bridge's provide() does with attention_backend=local, after the spec is built
    spec = branch_layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm"))
    spec.submodules.self_attention.submodules.core_attention = DotProductAttention
    model = GPTModel(llama_config(num_layers=1, hidden_size=64, num_attention_heads=4), spec, VOCAB, 64,
                     position_embedding_type="rope")
    with pytest.raises(ValueError, match="attention_backend: .*DotProductAttention"):
        check_branch_model([model])


# ---------------------------------------------------------------------------- two processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(case: str, world: int = 2, timeout: int = 420):
    """``world`` gloo processes running ``worker(case)``; their JSON results, by rank."""
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            env.pop("VERL_ENGINE_VENDOR", None)
            procs.append(subprocess.Popen([sys.executable, HERE, case, out], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
        for p, log in zip(procs, logs):
            assert p.returncode == 0, log[-4000:]
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def test_two_data_parallel_ranks_see_split_groups_and_equal_micro_batch_counts():
    """DP=2: verl hands rank 0 rollouts 0, 1, 3 and rank 1 rollouts 2, 4, 5 of two groups of three
    (as balance_batch can): both groups span both ranks, both ranks report it; under a budget that
    cuts a group on one rank both ranks run the same number of micro-batches; gradients are verl's."""
    results = run_ranks("dp")
    for r in results:
        assert r["grad_diff"] < TOL and r["logprob_diff"] < TOL and r["compared"] == 3
        assert r["split_groups"] == 2
    assert results[0]["micro_batches"] == results[1]["micro_batches"] == 3


def test_tensor_parallel_two_ranks_match_verls_stock_engine():
    """TP=2 (sequence parallel, as verl turns it on): the branch engine against verl's stock engine."""
    results = run_ranks("tp")
    for r in results:
        assert r["grad_diff"] < TOL and r["logprob_diff"] < TOL
    assert results[0]["compared"] == 6  # verl returns the outputs on the first TP rank


def worker(case: str, out: str) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    enable_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    torch.set_num_threads(1)
    cpu_shims()
    path = os.path.join(out, "ckpt")
    if rank == 0:
        write_checkpoint(path)
    dist.barrier()
    kwargs = {"tensor_model_parallel_size": 2} if case == "tp" else {}
    stock = new_engine(path, None, **kwargs)
    ours = new_engine(path, "branch", **kwargs)
    groups = (("a", 9, (4, 3, 5)), ("b", 6, (2, 4, 3)))
    if case == "dp":  # each DP rank gets half the batch: both groups span both ranks
        idx = [0, 1, 3] if rank == 0 else [2, 4, 5]
        # budget 15: rank 0's part of group a (16 unique tokens) is cut, giving 3 micro-batches;
        # rank 1 needs 2 and splits one to match
        batch = lambda: tu.index_select_tensor_dict(grpo_batch(groups=groups, max_token_len=15), idx)  # noqa: E731
    else:
        batch = lambda: grpo_batch(groups=groups)  # noqa: E731
    counts = []
    import megatron_branch.integrations.verl.engine as engine_module

    original = engine_module.group_micro_batches

    def counting(*args, **kwargs):
        mbs, idx = original(*args, **kwargs)
        counts.append(len(mbs))
        return mbs, idx

    engine_module.group_micro_batches = counting
    train_step(stock, batch())
    out_ours = train_step(ours, batch())
    grad_diff = max_grad_diff(grads(stock), grads(ours))
    with torch.no_grad(), cuda_factories_on_cpu():
        ref, got = (e.forward_backward_batch(batch(), None, forward_only=True) for e in (stock, ours))
    lp_diff, compared = 0.0, 0
    if "log_probs" in got.get("model_output", {}):
        for s, o in zip(ref["model_output"]["log_probs"].unbind(), got["model_output"]["log_probs"].unbind()):
            lp_diff = max(lp_diff, float((s[:-1] - o[:-1]).abs().max()))
            compared += 1
    result = {"grad_diff": grad_diff, "logprob_diff": lp_diff, "compared": compared, "micro_batches": counts[0],
              "split_groups": out_ours["metrics"]["branch/split_groups"][0]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
