"""Shared fixtures: CPU shims, a 1-process Megatron world, and model pairs.

The *naive truth* is a GPTModel built with Megatron's stock local spec and the same
weights, each rollout run alone with a causal mask (``megatron_branch.reference.naive``).
"""

import importlib.util
import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", module="megatron.core.transformer.transformer_config")

import megatron_branch as mb  # noqa: E402
from megatron_branch.distributed import init_distributed  # noqa: E402
from megatron_branch.spec.builders import build_gpt, llama_config  # noqa: E402

VOCAB = 128
TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def load_tool(name: str):
    """The module of the script ``tools/<name>.py`` (tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session", autouse=True)
def megatron_world():
    mb.enable_cpu()
    init_distributed()
    yield


def make_pair(backend="cascade", chunk_size=None, kernel=None, seed=0, vocab=VOCAB, **cfg):
    """(branch model, stock model) with identical weights."""
    defaults = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2)
    defaults.update(cfg)
    config = llama_config(**defaults)
    spec_kwargs = {"backend": backend, "chunk_size": chunk_size, "kernel": kernel}
    branch = build_gpt(config, vocab, spec_kwargs=spec_kwargs, seed=seed)
    stock = build_gpt(config, vocab, branch=False)
    stock.load_state_dict(branch.state_dict())
    return branch, stock


@pytest.fixture
def model_pair():
    return make_pair()


def rand_seq(gen, n, vocab=VOCAB):
    return torch.randint(0, vocab, (n,), generator=gen)
