"""Rollout routing replay (verl's ``megatron.router_replay.mode=R3``) through the branch engine.

A tiny Qwen3-MoE checkpoint (transformers), built by verl's ``EngineRegistry`` and
``initialize()`` on the CPU (gloo) through the vanilla ``mbridge`` path, with the routes of a
rollout in the batch as verl's agent loop leaves them (``routed_experts``: jagged
``[B, L_i, layers, topk]`` int16, the final token's row zero). The reference is verl's stock
``MegatronEngineWithLMHead`` replaying the same routes with its own router replay
(``set_router_replay_data``); it runs in a subprocess, since verl's replay patches Megatron's
``TopKRouter`` for the whole process (there, a branch engine built after it is refused).
Log-probs, entropy and ``ppo_loss`` gradients agree within 1e-5 (fp32), and differ from the
same engine's log-probs without the routes. Also: the routes' cut per sequence (MoE columns,
the last row), the refusals (R2, ``moe_router_fusion``, a batch without routes) and that
verl's patch stays off in the branch engine. Runs in the ``[verl]`` venv of ``.ci/run``.
"""

import os
import subprocess
import sys
import tempfile

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]': its own venv in .ci/run)")
pytest.importorskip("mbridge", reason="mbridge is not installed (pip install -e '.[verl]')")

from tensordict.tensorclass import NonTensorData  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

from megatron_branch.cpu import cuda_factories_on_cpu, enable_cpu  # noqa: E402
from megatron_branch.tree import BranchTree  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_verl_engine import VOCAB, cpu_shims, grads, grpo_batch, max_grad_diff, new_engine, train_step  # noqa: E402

TOL = 1e-5
HERE = os.path.abspath(__file__)
EXPERTS, TOPK, LAYERS = 8, 2, 2
# mbridge's Qwen3-MoE config asks for Transformer Engine's fused pieces; Megatron's local modules on CPU
MOE_OVERRIDES = {"moe_grouped_gemm": False, "persist_layer_norm": False, "moe_permute_fusion": False,
                 "bias_dropout_fusion": False, "bias_activation_fusion": False}


def write_moe_checkpoint(path: str, seed: int = 0) -> str:
    """A tiny Qwen3-MoE checkpoint with a tokenizer: 2 MoE layers, 8 experts, top-2."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=EXPERTS, num_experts_per_tok=TOPK, decoder_sparse_step=1, mlp_only_layers=[],
                            max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5,
                            norm_topk_prob=True, router_aux_loss_coef=0.0)
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")), pad_token="t0",
                            unk_token="t1", eos_token="t2", bos_token="t3").save_pretrained(path)
    return path


def r3_engine(path: str, vendor, **kwargs):
    from verl.workers.config.engine import EngineRouterReplayConfig

    overrides = dict(MOE_OVERRIDES, **kwargs.pop("override_transformer_config", {}))
    return new_engine(path, vendor, router_replay=EngineRouterReplayConfig(mode=kwargs.pop("mode", "R3")),
                      override_transformer_config=overrides, **kwargs)


def routes_of(sequences, seed: int = 3) -> list:
    """Random top-k experts per token of the sequences' prefix tree (rollouts sharing a token
    get the same ones, as a prefix-cached engine records them), per rollout
    ``[L_i, layers, topk]`` int16 with the final token's row zero (verl's agent loop)."""
    g = torch.Generator().manual_seed(seed)
    tree = BranchTree.from_sequences(sequences)
    experts = torch.rand(tree.unique_positions, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOPK]
    out = []
    for i, s in enumerate(sequences):
        part = experts[tree.rows[i, : len(s)]].to(torch.int16)
        part[-1] = 0
        out.append(part)
    return out


def r3_batch(replay: bool = True, **kwargs):
    """``grpo_batch`` with the rollout's routes and verl's per-call flag (compute_log_prob and
    update_actor set ``enable_routing_replay``; compute_ref_log_prob does not)."""
    td = grpo_batch(**kwargs)
    sequences = list(td["input_ids"].unbind())
    td["routed_experts"] = torch.nested.as_nested_tensor(routes_of(sequences), layout=torch.jagged)
    tu.assign_non_tensor(td, enable_routing_replay=replay)
    return td


def forward(engine, batch):
    with torch.no_grad(), cuda_factories_on_cpu():
        return engine.forward_backward_batch(batch, None, forward_only=True)["model_output"]


@pytest.fixture(scope="module")
def moe_checkpoint():
    with tempfile.TemporaryDirectory() as path:
        yield write_moe_checkpoint(path)


@pytest.fixture
def ours(moe_checkpoint, monkeypatch):
    cpu_shims(monkeypatch)
    engine = r3_engine(moe_checkpoint, "branch")
    yield engine
    os.environ.pop("VERL_ENGINE_VENDOR", None)


# ---------------------------------------------------------------------------- tests
def test_r3_log_probs_entropy_and_gradients_match_verls_stock_router_replay(ours, moe_checkpoint):
    """verl's stock engine replaying the same routes (its patch, in a subprocess) against the branch engine."""
    with tempfile.TemporaryDirectory() as out:
        (stock,) = run("stock", moe_checkpoint, out)
    # a branch engine built after verl's patch (in that process) refuses: its replay would route natively
    assert "megatron.router_replay.mode=R3" in stock["refused"] and "verl's router replay patch" in stock["refused"]
    train_step(ours, r3_batch())
    assert max_grad_diff(stock["grads"], grads(ours)) < TOL
    got = forward(ours, r3_batch())
    for key in ("log_probs", "entropy"):
        for s, o in zip(stock[key], got[key].unbind()):
            # the last position predicts past the sequence (no route recorded for it); verl's loss never reads it
            assert s.shape == o.shape and (s[:-1] - o[:-1]).abs().max() < TOL
    # the routes are applied: without them (verl's reference pass) the router picks its own experts
    native = forward(ours, r3_batch(replay=False))
    diff = max(float((a[:-1] - b[:-1]).abs().max()) for a, b in zip(native["log_probs"].unbind(),
                                                                   got["log_probs"].unbind()))
    assert diff > 1e-3


def test_tensor_parallel_two_ranks_match_verls_stock_router_replay(moe_checkpoint):
    """TP=2 (sequence parallel, as verl turns it on: verl scatters the routes over the sequence
    parallel ranks) against verl's stock engine at TP=2 replaying the same routes."""
    with tempfile.TemporaryDirectory() as out:
        stock = run("stock-tp", moe_checkpoint, out, world=2)
        ours = run("ours-tp", moe_checkpoint, out, world=2)
    for s, o in zip(stock, ours):  # each rank's shards
        assert max_grad_diff(s["grads"], o["grads"]) < TOL
    assert len(ours[0]["log_probs"]) == 5
    for key in ("log_probs", "entropy"):
        for s, o in zip(stock[0][key], ours[0][key]):
            assert s.shape == o.shape and (s[:-1] - o[:-1]).abs().max() < TOL
    assert max(float((a[:-1] - b[:-1]).abs().max()) for a, b in zip(ours[0]["native"], ours[0]["log_probs"])) > 1e-3


def test_the_streamed_forward_only_pass_replays_the_routes(ours):
    """With ``max_chunk_tokens`` verl's old-log-prob pass streams the tree (replay_logprobs)
    with the same routes: the same log-probs as one forward."""
    batch = r3_batch()
    tu.assign_non_tensor(batch, calculate_entropy=False)
    whole = forward(ours, batch)["log_probs"]
    ours.branch_options = ours.branch_options.__class__(kernel=ours.branch_options.kernel, max_chunk_tokens=8)
    streamed = forward(ours, batch)["log_probs"]
    for a, b in zip(whole.unbind(), streamed.unbind()):
        assert (a[:-1] - b[:-1]).abs().max() < TOL


def test_routes_are_cut_per_sequence(ours):
    """MoE columns only, the final row filled from a rollout that continues past the token or
    from the previous row; one row fewer than the tokens is the rollout engine's own layout."""
    from megatron_branch.integrations.verl.engine import moe_routers, rollout_routing

    routers = moe_routers(ours.module[0])
    assert [int(r.layer_number) for r in routers] == [1, 2]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, VOCAB, (5,), generator=g)
    longer = torch.cat([prompt, torch.tensor([7, 8, 9])])
    sequences = [prompt, longer, torch.cat([prompt, torch.tensor([4])])]  # the first ends where the second goes on
    parts = routes_of(sequences)
    parts[2] = parts[2][:-1]  # no row for the final token at all
    parts[1][-3:] = 0  # the engine recorded nothing after position 4 (verl's agent loop leaves zeros)
    td = tu.get_tensordict({"input_ids": torch.nested.as_nested_tensor(sequences, layout=torch.jagged),
                            "routed_experts": torch.nested.as_nested_tensor(parts, layout=torch.jagged)})
    cut = rollout_routing(td, routers, LAYERS)
    assert [tuple(c.shape) for c in cut] == [(5, 2, 2), (8, 2, 2), (6, 2, 2)]
    assert torch.equal(cut[0][-1], cut[1][4])  # the token the second rollout continues from: its row
    assert torch.equal(cut[2][-1], cut[2][-2])
    assert all(torch.equal(cut[1][t], cut[1][4]) for t in (5, 6, 7))  # trailing zero rows: the last recorded
    assert torch.equal(cut[1][:5], parts[1][:5]) and torch.equal(cut[2][:5], parts[2][:5])
    # a rollout engine that records every decoder layer, of which only the second is MoE here
    only_second = rollout_routing(td, routers[1:], LAYERS)
    assert torch.equal(only_second[1], cut[1][:, 1:])
    three = torch.nested.as_nested_tensor([torch.zeros(len(s), 3, 2, dtype=torch.int16) for s in sequences],
                                          layout=torch.jagged)
    with pytest.raises(ValueError, match="routed_experts: sample 0 has 3 layers"):
        rollout_routing(tu.get_tensordict({"input_ids": td["input_ids"], "routed_experts": three}), routers, LAYERS)


def test_the_branch_engine_keeps_megatrons_router_replay(ours):
    """verl's replay patch (its own RouterReplay and routing in every TopKRouter) stays off:
    the routers hold Megatron's RouterReplay, which the package drives."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_branch.integrations.verl.engine import moe_routers

    assert not hasattr(TopKRouter, "_router_replay_patched")
    assert all(type(r.router_replay) is RouterReplay for r in moe_routers(ours.module[0]))
    assert ours.tf_config.moe_enable_routing_replay and not ours.tf_config.moe_router_fusion


def test_a_batch_without_routes_is_refused(ours):
    batch = r3_batch()
    del batch["routed_experts"]
    with pytest.raises(ValueError, match="routed_experts: .*enable_rollout_routing_replay=True"):
        forward(ours, batch)


def test_r2_and_fused_routing_are_refused(moe_checkpoint, monkeypatch):
    from verl.workers.config.engine import EngineRouterReplayConfig

    from megatron_branch.integrations.verl import check_config, check_micro_batch

    cpu_shims(monkeypatch)
    for kwargs, option in (({"mode": "R2"}, "megatron.router_replay.mode=R2"),
                           ({"override_transformer_config": {"moe_router_fusion": True}},
                            "moe_router_fusion=True"),
                           ({"override_transformer_config": {"moe_enable_routing_replay": False}},
                            "moe_enable_routing_replay=False")):
        built = []
        monkeypatch.setattr("verl.workers.engine.megatron.transformer_impl.MegatronEngine._build_megatron_module",
                            lambda self: built.append(1))
        with pytest.raises(ValueError, match=option):
            r3_engine(moe_checkpoint, "branch", **kwargs)
        assert not built  # refused before verl builds anything
    os.environ.pop("VERL_ENGINE_VENDOR", None)
    from verl.workers.config import McoreEngineConfig

    check_config(McoreEngineConfig(router_replay=EngineRouterReplayConfig(mode="R3")), None)  # accepted
    batch = grpo_batch()
    tu.assign_non_tensor(batch, enable_routing_replay=True)
    check_micro_batch(batch)  # verl's flag for R3 is accepted; R2's recording is not
    batch["record_r2_routes"] = NonTensorData(True)
    with pytest.raises(ValueError, match="record_r2_routes"):
        check_micro_batch(batch)


# ---------------------------------------------------------------------------- verl's stock engine, its own process
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(kind: str, path: str, out: str, world: int = 1, timeout: int = 420) -> list:
    """``world`` gloo processes running :func:`worker` ``kind``; their results, by rank."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        env.pop("VERL_ENGINE_VENDOR", None)
        procs.append(subprocess.Popen([sys.executable, HERE, kind, path, out], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [torch.load(os.path.join(out, f"{kind}{rank}.pt")) for rank in range(world)]


def worker(kind: str, path: str, out: str) -> None:
    """``stock``: verl's stock engine with router_replay.mode=R3 (its patch applied by its
    __init__), then a branch engine in the same process (refused); ``stock-tp`` / ``ours-tp``:
    verl's stock engine / the branch engine at tensor parallelism 2 (sequence parallel)."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    enable_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    torch.set_num_threads(1)
    cpu_shims()
    from verl.utils.megatron import router_replay_utils

    router_replay_utils.device_name = "cpu"  # verl moves the routes to its accelerator's name ("cuda" on this machine)
    kwargs = {"tensor_model_parallel_size": 2} if kind.endswith("-tp") else {}
    engine = r3_engine(path, "branch" if kind.startswith("ours") else None, **kwargs)
    train_step(engine, r3_batch())
    result = {"grads": grads(engine)}
    model_output = forward(engine, r3_batch())
    for key in ("log_probs", "entropy"):
        if key in model_output:  # verl returns the outputs on the first tensor-parallel rank
            result[key] = [x.clone() for x in model_output[key].unbind()]
    if kind == "ours-tp" and "log_probs" in model_output:  # without the routes, for the check that they apply
        result["native"] = [x.clone() for x in forward(engine, r3_batch(replay=False))["log_probs"].unbind()]
    elif kind == "ours-tp":
        forward(engine, r3_batch(replay=False))
    if kind == "stock":
        try:  # verl's patch is now in this process: the branch engine's routers would hold verl's RouterReplay
            r3_engine(path, "branch")
            result["refused"] = ""
        except ValueError as exc:
            result["refused"] = str(exc)
    torch.save(result, os.path.join(out, f"{kind}{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(*sys.argv[1:4])
