"""Megatron-LM with the branch spec and the RL patch, on CPU.

Every test needs ``MEGATRON_LM_DIR``: a Megatron-LM git checkout at a version that has a
folder under ``patches/`` (``core_v0.16.1``, ``core_v0.19.0``, ``main`` at the commit its
``UPSTREAM`` names), with that folder's patches applied (``python tools/apply_patches.py
--checkout DIR --upstream megatron-lm --apply``), and the ``megatron-lm`` extra installed;
otherwise they are skipped with the reason. From ``core_v0.19.0`` Megatron-LM declares
Python >= 3.12: on Python 3.11 ``tools/python311`` (its ``typing.override`` shim) goes
first on the path. The tests call Megatron-LM in the pytest process, so its ``megatron``
package must be the one imported:

    D=/path/to/Megatron-LM  # e.g. checked out at core_v0.19.0 and patched
    MEGATRON_LM_DIR=$D PYTHONPATH=tools/python311:$D python -m pytest -q tests/test_megatron_lm.py

* pretraining: ``examples/megatron_lm/pretrain_branch.py`` runs Megatron-LM's ``pretrain``
  for 2 iterations on 2 gloo processes with ``--spec megatron_branch.integrations.megatron_lm
  branch_layer_spec`` (``core_v0.19.0``: through ``gpt_config_from_args`` and the config
  container);
* RL: with ``--rl-branch-replay`` Megatron-RL's old/reference log-probs
  (``prepare_data_for_update``) and its policy-update forward (``train_rl.forward_step``:
  GRPO loss and gradients) equal those of the unpatched path (``--rl-branch-replay`` off,
  the stock spec, ``get_logprobs``) on synthetic GRPO trajectories.
"""

import importlib.util
import inspect
import math
import os
import re
import sys

import pytest
import torch
from conftest import make_pair

from megatron_branch.commands.synthetic import branching_rollouts
from megatron_branch.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(ROOT, "examples", "megatron_lm", "pretrain_branch.py")
PY311_SHIM = os.path.join(ROOT, "tools", "python311")
# import names of setup.py's ``megatron-lm`` extra
EXTRA_MODULES = ("triton", "tensorboard", "wandb", "pydantic", "yaml", "regex", "transformers", "fastapi",
                 "uvicorn", "httpx", "openai", "aiohttp", "omegaconf")


def _load_tool():
    spec = importlib.util.spec_from_file_location("apply_patches", os.path.join(ROOT, "tools", "apply_patches.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checkout_release(path):
    """``(major, minor)`` of the checkout's ``megatron/core/package_info.py``."""
    text = open(os.path.join(path, "megatron", "core", "package_info.py"), encoding="utf-8").read()
    return tuple(int(re.search(rf"^{k} = (\d+)", text, re.M).group(1)) for k in ("MAJOR", "MINOR"))


def skip_reason():
    """Why the Megatron-LM tests cannot run here, or None."""
    path = os.environ.get("MEGATRON_LM_DIR")
    tool = _load_tool()
    if not path:
        return ("MEGATRON_LM_DIR is not set (a Megatron-LM checkout of a version under patches/, its patches "
                "applied)")
    folder = tool.folder_for(path, "megatron-lm")
    if folder is None:
        _, known = tool.select_folders(tool.PATCHES, "megatron-lm", [], "")
        return (f"MEGATRON_LM_DIR={path} (tags {tool.checkout_tags(path) or 'none'}, commit "
                f"{tool.checkout_commit(path)[:10]}) has no patch folder; patches exist for {', '.join(known)}")
    if not tool.patches_applied(path, folder):
        return (f"MEGATRON_LM_DIR={path}: patches/{os.path.basename(folder)} is not applied (python "
                f"tools/apply_patches.py --checkout {path} --upstream megatron-lm --apply)")
    missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return f"Megatron-LM's packages missing: {', '.join(missing)} (pip install -e '.[megatron-lm]')"
    import megatron.core

    imported = os.path.realpath(os.path.dirname(megatron.core.__file__))
    if not imported.startswith(os.path.realpath(path) + os.sep):
        # the tests call Megatron-LM in this process: its megatron/core must be the one imported
        return (f"megatron.core is imported from {imported}, not from MEGATRON_LM_DIR: run pytest with "
                f"PYTHONPATH={os.pathsep.join(python_path(path))}")
    if sys.version_info < (3, 12) and not hasattr(__import__("typing"), "override"):
        return f"Python 3.11 and Megatron-LM >= core_v0.19.0: put {PY311_SHIM} first on PYTHONPATH"
    return None


def python_path(checkout=None):
    """The ``PYTHONPATH`` entries of a Megatron-LM process: the checkout, after the Python
    3.11 shim from ``core_v0.19.0`` on."""
    path = [checkout or os.environ["MEGATRON_LM_DIR"]]
    if sys.version_info < (3, 12) and checkout_release(path[0]) >= (0, 19):
        path.insert(0, PY311_SHIM)
    return path


SKIP = skip_reason()
RELEASE = checkout_release(os.environ["MEGATRON_LM_DIR"]) if SKIP is None else None
pytestmark = [pytest.mark.megatron_lm, pytest.mark.skipif(SKIP is not None, reason=str(SKIP))]


# ----------------------------------------------------------------------------- pretraining
TINY = [
    "--spec", "megatron_branch.integrations.megatron_lm", "branch_layer_spec",
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--use-cpu-initialization",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--ffn-hidden-size", "128", "--normalization", "RMSNorm", "--swiglu",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--seq-length", "64", "--max-position-embeddings", "64",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2",
    "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "constant", "--clip-grad", "1.0",
    "--dataloader-type", "external", "--calculate-per-token-loss",
    "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
    "--branch-prompt-length", "24", "--branch-fanout", "2", "2", "--branch-segment-lengths", "8", "8",
]


def run_pretrain(nproc, *flags):
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(python_path()), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", PRETRAIN, *TINY, *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr  # Megatron-LM logs some lines (core_v0.19.0: the vocabulary) to stderr


def logged(out, key="lm loss"):
    """The value of ``key`` in each iteration line of Megatron-LM's ``training_log``."""
    return [float(x) for x in re.findall(rf"iteration\s+\d+/\s*\d+ \|.*?{key}: ([0-9.eE+-]+)", out)]


def test_pretrain_two_processes_two_iterations():
    out = run_pretrain(2)
    losses = logged(out)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), out[-3000:]
    assert "iteration        2/       2" in out
    # nothing learnt yet: about the uniform cross-entropy over the padded vocabulary (core_v0.16.1:
    # NullTokenizer's 128 + eod, padded to 256; core_v0.19.0: 128)
    padded = int(re.search(r"padded vocab \(size: \d+\) with \d+ dummy tokens \(new size: (\d+)\)", out).group(1))
    assert abs(losses[0] - math.log(padded)) < 0.1, padded
    # whole trees per DP rank and per-token normalisation: the same steps on 1 process
    single = run_pretrain(1)
    for key in ("lm loss", "grad norm"):
        assert len(logged(out, key)) == 2
        assert logged(single, key) == pytest.approx(logged(out, key), rel=1e-5), key


def test_pretrain_moe_layer_pattern_and_qk_layernorm():
    out = run_pretrain(1, "--qk-layernorm", "--num-experts", "4", "--moe-layer-freq", "[0,1]",
                       "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather",
                       "--moe-ffn-hidden-size", "64")
    losses = logged(out)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), out[-3000:]


# ----------------------------------------------------------------------------- RL
PAD, EOD = 126, 127
SEQ = 40
GROUP = 4


class Tokenizer:
    """The fields of Megatron's tokenizer that Megatron-RL reads (as in its own unit tests)."""

    pad, eod, bos, vocab_size, library = PAD, EOD, None, 128, None

    def detokenize(self, tokens):
        return " ".join(str(t) for t in tokens)


class StockAsMegatronRL(torch.nn.Module):
    """The stock-spec model as Megatron-RL calls it, in fp32 on CPU.

    ``get_logprobs`` passes ``fp32_output=`` (only the bf16 ``Float16Module`` accepts it)
    and, in the unpacked update path, a no-op THD ``packed_seq_params`` (one sequence
    spanning each row: plain causal attention, which Transformer Engine computes from it
    and Megatron's local attention refuses). This wrapper accepts both, checking that the
    packed parameters are the no-op ones.
    """

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = module.config

    def state_dict(self, *args, **kwargs):  # as Megatron's wrappers: the wrapped model's names
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True):
        return self.module.load_state_dict(state_dict, strict)

    def forward(self, tokens, position_ids, attention_mask, packed_seq_params=None, fp32_output=True, **kwargs):
        from megatron.core.transformer.module import Float16Module

        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q
            assert int(cu[0]) == 0 and bool((cu[1:] == tokens.shape[1]).all()), cu
        if isinstance(self.module, Float16Module):
            kwargs["fp32_output"] = fp32_output
        return self.module(tokens, position_ids, attention_mask, **kwargs)


def stock_name(name):
    """A parameter's name without the wrappers' ``module.`` prefixes."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def grpo_rollouts():
    """2 prompts x GROUP rollouts sharing their prompt (and pairwise a response stem),
    eod-terminated, with rewards; as Megatron-RL's ``TokenRollout`` groups."""
    from megatron.rl.agent.api import TokenRollout

    batch = branching_rollouts([10, 7], [2, 2], [4, 5], vocab_size=100, seed=3, jitter=3)
    groups = []
    for g in range(2):
        group = []
        for r in [i for i, x in enumerate(batch.group) if x == g]:
            seq = batch.sequences[r].tolist() + [EOD]
            plen = batch.prompt_lengths[r]
            fields = dict(trajectory=[seq], reward=float((r * 7) % 5) / 4, env_id="synthetic", problem_id=str(g),
                          generation_mask=[[i >= plen for i in range(len(seq))]], logprobs=[[-1.0] * len(seq)])
            if "policy_epoch" in TokenRollout.model_fields:  # core_v0.19.0: which policy generated what
                fields.update(policy_epoch=[[(0, 0)]], kv_cache_epoch=[[(0, 0)]], num_evictions=[0])
            group.append(TokenRollout(**fields))
        groups.append(group)
    return groups


@pytest.fixture
def megatron_rl(monkeypatch):
    """Megatron-LM's global arguments (``validate_args``) and the CPU shims, torn down after."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args

    from megatron_branch.cpu import megatron_lm_on_cpu

    def configure(branch_replay: bool, bf16: bool = False, **overrides):
        global_vars.destroy_global_vars()
        destroy_num_microbatches_calculator()
        monkeypatch.setattr(sys, "argv", ["train_rl.py"])
        args = parse_args()
        fields = dict(
            num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=SEQ,
            max_position_embeddings=SEQ, micro_batch_size=GROUP, global_batch_size=2 * GROUP,
            grpo_prompts_per_step=2, grpo_group_size=GROUP, curr_iteration=1, attention_dropout=0.0,
            hidden_dropout=0.0, grpo_kl_beta=0.1, grpo_entropy_term_weight=0.01, grpo_clamp_eps_lower=0.05,
            grpo_clamp_eps_upper=0.05, check_for_nan_in_loss_and_grad=False, rl_branch_replay=branch_replay,
            wandb_project=None, transformer_impl="local", bf16=bf16,
        )
        for key, value in {**fields, **overrides}.items():
            setattr(args, key, value)
        validate_args(args)
        global_vars.set_global_variables(args, build_tokenizer=False)
        global_vars._GLOBAL_TOKENIZER = Tokenizer()
        return args

    with megatron_lm_on_cpu():
        yield configure
    global_vars.destroy_global_vars()
    destroy_num_microbatches_calculator()


def rl_step(model, ref_state, branch_replay, configure, perturb):
    """Old/ref log-probs, then the policy update's forward and backward on two micro-batches.

    Returns ``(micro-batches, per-token losses, (loss_sum, tokens, clipped tokens))``;
    gradients land in ``model``'s ``.grad``."""
    import train_rl
    from megatron.rl import rl_utils

    configure(branch_replay, bf16=next(model.parameters()).dtype == torch.bfloat16)
    ref_state = {k: ref_state[stock_name(k)] for k in model.state_dict()}
    extra = {}
    if "request_ledger" in inspect.signature(rl_utils.prepare_data_for_update).parameters:
        extra["request_ledger"] = {}  # main: per-request records; these rollouts name no completions
    data = rl_utils.prepare_data_for_update([model], ref_state, grpo_rollouts(), Tokenizer(),
                                            sequence_packing=False, is_correction=False, **extra)
    if isinstance(data, tuple):  # core_v0.19.0: (data iterator, group stats, example groups)
        data = data[0]
    batches = [next(data) for _ in range(2)]
    with torch.no_grad():  # the policy moved since the rollouts: ratios != 1, some clipped
        for name, p in model.named_parameters():
            p.add_(perturb[stock_name(name)].to(p.dtype))
    losses, sums = [], []
    for batch in batches:
        output, loss_func = train_rl.forward_step(iter([batch]), model)
        loss, tokens, report = loss_func(output)
        loss.backward()
        losses.append(output.detach())
        clipped = float(report["rl/truncated_from_above"][0] + report["rl/truncated_from_below"][0])
        sums.append((float(loss), int(tokens), clipped))
    return batches, losses, sums


def ref_and_perturbation(stock):
    """A reference policy's state and the policy's move since the rollouts, by stock name."""
    gen = torch.Generator().manual_seed(9)
    ref_state = {k: v + 0.02 * torch.randn(v.shape, generator=gen) if torch.is_tensor(v) and v.is_floating_point()
                 else v for k, v in stock.state_dict().items()}
    perturb = {name: 0.01 * torch.randn(p.shape, generator=gen) for name, p in stock.named_parameters()}
    return ref_state, perturb


def test_rl_branch_replay_matches_unpatched_logprobs_loss_and_grads(megatron_rl):
    branch, stock = make_pair(seed=5)
    ref_state, perturb = ref_and_perturbation(stock)

    want_batches, want_losses, want_sums = rl_step(StockAsMegatronRL(stock), ref_state, False, megatron_rl, perturb)
    got_batches, got_losses, got_sums = rl_step(branch, ref_state, True, megatron_rl, perturb)

    for want, got in zip(want_batches, got_batches):
        tokens, _, old_want, mask, _, ref_want, _ = want
        _, _, old_got, _, _, ref_got, _ = got
        assert torch.equal(tokens, got[0]) and old_got.dtype == torch.float32
        lengths = (tokens != PAD).sum(1)  # content ends in eod; pad != eod here
        inside = torch.arange(SEQ - 1)[None, :] < (lengths - 1)[:, None]  # [mbs, S - 1]
        for w, g in ((old_want, old_got), (ref_want, ref_got)):
            assert torch.isfinite(g).all()
            assert (g[~inside] == 0).all()  # filled past each end
            torch.testing.assert_close(g[inside], w[inside], atol=1e-5, rtol=0)
        assert (old_want - ref_want)[inside].abs().max() > 1e-3  # the reference policy differs
    for (want_loss, want_tokens, want_clipped), (got_loss, got_tokens, got_clipped) in zip(want_sums, got_sums):
        assert want_tokens == got_tokens > 0 and want_clipped == got_clipped
        assert math.isfinite(got_loss)
        assert abs(got_loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
    assert sum(clipped for _, _, clipped in got_sums) > 0  # the clip is exercised
    for batch, want, got in zip(want_batches, want_losses, got_losses):
        mask = batch[3][:, 1:].bool()
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)
    grads = dict(stock.named_parameters())
    for name, p in branch.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("overrides, flag", [
    (dict(rl_use_sequence_packing=True), "--rl-use-sequence-packing"),
    (dict(hidden_dropout=0.1), "dropout"),
    (dict(reset_position_ids=True), "--reset-position-ids"),
    (dict(micro_batch_size=GROUP + 2, global_batch_size=GROUP + 2), "--micro-batch-size"),
    (dict(rl_branch_replay_max_chunk_tokens=0), "--rl-branch-replay-max-chunk-tokens"),
    # options of later releases (skipped where the release has none)
    (dict(batch_invariant_mode=True), "--batch-invariant-mode"),
    (dict(cuda_graph_impl="local"), "--cuda-graph-impl"),
    (dict(hybrid_layer_pattern="M*"), "--hybrid-layer-pattern"),
])
def test_rl_branch_replay_refusals(megatron_rl, overrides, flag):
    key = next(iter(overrides))
    if not hasattr(megatron_rl(False), key):
        pytest.skip(f"{key}: not an option of Megatron-LM {RELEASE[0]}.{RELEASE[1]}")
    megatron_rl(False, **overrides)  # without the flag Megatron-RL accepts them
    with pytest.raises(ValueError, match=f"--rl-branch-replay: .*{flag}|{flag}"):
        megatron_rl(True, **overrides)


# ----------------------------------------------------------------------------- --spec object
def test_args_branch_spec_resolves_from_megatron_lm_arguments(megatron_rl):
    from megatron.training import get_args

    from megatron_branch.integrations.megatron_lm import ArgsBranchSpec
    from megatron_branch.spec.core_attention import BranchCoreAttention

    megatron_rl(False)
    args = get_args()
    args.qk_layernorm = True
    spec = ArgsBranchSpec()  # what --spec megatron_branch.integrations.megatron_lm branch_layer_spec hands GPTModel
    attn = spec.submodules.self_attention.submodules
    assert attn.core_attention.module is BranchCoreAttention and attn.q_layernorm is not None
    args.num_experts, args.virtual_pipeline_model_parallel_size = 4, 2
    with pytest.raises(ValueError, match="--virtual-pipeline-model-parallel-size"):
        ArgsBranchSpec().module


def test_rl_branch_replay_bf16_within_twice_the_stock_bf16_error(megatron_rl):
    """Megatron-RL runs bf16 (``Float16Module``): the patched path's error against the fp32
    truth is at most twice the unpatched path's, and its old/ref log-probs stay fp32."""
    from megatron.core.transformer.module import Float16Module

    _, truth = make_pair(seed=5)
    ref_state, perturb = ref_and_perturbation(truth)
    _, truth_losses, _ = rl_step(StockAsMegatronRL(truth), ref_state, False, megatron_rl, perturb)
    errors = {}
    for branch_replay in (False, True):
        pair = make_pair(seed=5, bf16=True)
        model = Float16Module(pair[0].config, pair[0] if branch_replay else pair[1])
        batches, losses, _ = rl_step(model if branch_replay else StockAsMegatronRL(model), ref_state,
                                     branch_replay, megatron_rl, perturb)
        assert (batches[0][2].dtype == torch.float32) == branch_replay  # old log-probs
        masks = [b[3][:, 1:].bool() for b in batches]
        loss_err = max((g.float() - w)[m].abs().max().item() for g, w, m in zip(losses, truth_losses, masks))
        grads = dict((stock_name(n), p.grad.float()) for n, p in model.named_parameters())
        grad_err = max(((grads[n] - p.grad).norm() / p.grad.norm()).item() for n, p in truth.named_parameters())
        errors[branch_replay] = (loss_err, grad_err)
    (stock_loss, stock_grad), (ours_loss, ours_grad) = errors[False], errors[True]
    assert stock_loss > 0 and stock_grad > 0  # bf16 is not exact
    assert ours_loss <= 2 * stock_loss and ours_grad <= 2 * stock_grad, errors
