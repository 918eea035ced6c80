"""Megatron-LM's ``pretrain`` with branch replay: one packed rollout tree per micro-batch.

Runs ``megatron.training.pretrain`` of a Megatron-LM checkout (``core_v0.16.1``; for
``core_v0.19.0`` and ``main`` see the end of this docstring) with Megatron-LM's own model
provider (``model_provider.model_provider`` + ``gpt_builders.gpt_builder``) and the branch
spec given on the command line:

    --spec megatron_branch.integrations.megatron_lm branch_layer_spec

(the spec builds itself from Megatron-LM's parsed arguments: normalization, qk-layernorm,
MoE layer pattern, ...). ``--dataloader-type external`` hands this script's data provider
to the training loop as is: every micro-batch is a
:class:`~megatron_branch.training.batching.TreeMicroBatch` of synthetic branching rollouts
(:func:`megatron_branch.commands.synthetic.branching_rollouts`; ``--micro-batch-size`` prompts per
tree, ``--global-batch-size`` prompts per step, a prompt's group never split across
data-parallel ranks), and the forward step is
:func:`megatron_branch.training.schedule.make_forward_step` with a response-token cross-entropy
summed over tokens. Megatron divides the gradients by the global token count, which needs
``--calculate-per-token-loss`` (set here if missing).

What to clone: Megatron-LM at one of the versions this script is tested on, tag
``core_v0.16.1`` or ``core_v0.19.0``, or ``main`` at commit ``d98e8a64dd``, and the
``megatron-lm`` extra of this package (Megatron-LM's own dependencies)::

    git clone https://github.com/NVIDIA/Megatron-LM /path/to/Megatron-LM
    git -C /path/to/Megatron-LM checkout core_v0.16.1
    pip install -e ".[megatron-lm]"

No patch is needed for this script: it uses Megatron-LM's extension points (``--spec``,
the forward step, the external data loader). The patches under ``patches/`` change only
Megatron-RL (``train_rl.py``, ``megatron/rl/rl_utils.py`` and the ``--rl-branch-replay``
flags in ``megatron/training/arguments.py``); a patched checkout runs this script
unchanged (``tests/test_megatron_lm.py``, which also tests the RL path, runs it on one).

CPU, 2 gloo processes (Megatron-LM's CUDA assumptions are shimmed by
:func:`megatron_branch.cpu.megatron_lm_on_cpu`, applied only when CUDA is absent)::

    MEGATRON_LM_DIR=/path/to/Megatron-LM  # the checkout above (core_v0.16.1; no patch needed)
    PYTHONPATH=$MEGATRON_LM_DIR torchrun --nproc_per_node 2 \\
        examples/megatron_lm/pretrain_branch.py \\
        --spec megatron_branch.integrations.megatron_lm branch_layer_spec \\
        --distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion \\
        --no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion \\
        --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion \\
        --use-cpu-initialization \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention \\
        --num-query-groups 2 --ffn-hidden-size 128 --normalization RMSNorm --swiglu \\
        --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights \\
        --attention-dropout 0 --hidden-dropout 0 \\
        --seq-length 64 --max-position-embeddings 64 \\
        --tokenizer-type NullTokenizer --vocab-size 128 \\
        --micro-batch-size 1 --global-batch-size 4 --train-iters 2 \\
        --lr 1e-4 --min-lr 1e-5 --lr-decay-style constant --clip-grad 1.0 \\
        --dataloader-type external --calculate-per-token-loss --eval-iters 0 --eval-interval 1000 --log-interval 1 \\
        --branch-prompt-length 24 --branch-fanout 2 2 --branch-segment-lengths 8 8

On GPUs drop the CPU-only flags (``--distributed-backend``, the ``--no-*-fusion`` flags,
``--use-cpu-initialization``) and use NCCL as usual; ``--transformer-impl
transformer_engine`` builds the branch spec on TE's layers (not yet run on a GPU).

Limits: no pipeline parallelism here (Megatron-LM's schedule sizes the stage-to-stage
tensors from ``--seq-length``/``--micro-batch-size``; use
:func:`megatron_branch.training.schedule.forward_backward` with ``variable_seq_lengths``). Trees
carry their own lengths; ``--seq-length`` only has to satisfy Megatron's argument checks.
MoE router statistics (aux/z losses, token dropping) count unique tree tokens, not
rollout tokens. Logged ``lm loss`` is the response-token cross-entropy averaged over the
global token count.

Megatron-LM ``core_v0.19.0`` and ``main``: ``pretrain(cfg_container, ...)`` takes a config
container built from the parsed arguments; this script then goes through
``parse_and_validate_args`` -> ``gpt_config_from_args`` (``--spec`` imported into
``GPTModelConfig.transformer_layer_spec``) -> ``pretrain_cfg_container_from_args`` and
lets Megatron-LM build the model from the config. Those releases declare Python >= 3.12;
on Python 3.11 put ``tools/python311`` (a ``typing.override`` shim) first on the path::

    PYTHONPATH=tools/python311:$MEGATRON_LM_DIR torchrun --nproc_per_node 2 \\
        examples/megatron_lm/pretrain_branch.py ...  # the flags above
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch

if os.environ.get("MEGATRON_LM_DIR") and os.environ["MEGATRON_LM_DIR"] not in sys.path:
    sys.path.insert(0, os.environ["MEGATRON_LM_DIR"])  # model_provider.py, gpt_builders.py

from megatron_branch.commands.synthetic import branching_rollouts  # noqa: E402
from megatron_branch.losses import response_mask, sft_loss  # noqa: E402
from megatron_branch.training.batching import TreeMicroBatch  # noqa: E402
from megatron_branch.training.schedule import make_forward_step  # noqa: E402
from megatron_branch.tree import BranchTree  # noqa: E402


def add_branch_args(parser):
    """Megatron-LM ``extra_args_provider``: the synthetic rollouts' shape."""
    group = parser.add_argument_group("branch replay (synthetic rollouts)")
    group.add_argument("--branch-prompt-length", type=int, default=24, help="tokens per prompt")
    group.add_argument("--branch-fanout", type=int, nargs="+", default=[2, 2],
                       help="children per node at each response level (GRPO: one level of G)")
    group.add_argument("--branch-segment-lengths", type=int, nargs="+", default=[8, 8],
                       help="tokens per response segment at each level")
    return parser


def check_args(args) -> None:
    """Refuse settings this entry point cannot honour.

    Raises:
        ValueError: naming the flag.
    """
    if args.dataloader_type != "external":
        raise ValueError(f"--dataloader-type: must be external (trees are made here), got {args.dataloader_type}")
    if not args.calculate_per_token_loss:
        raise ValueError("--calculate-per-token-loss: required; micro-batches are whole trees of unequal size")
    if args.pipeline_model_parallel_size > 1:
        raise ValueError("--pipeline-model-parallel-size: Megatron-LM's schedule sizes stage-to-stage tensors "
                         "from --seq-length; use megatron_branch.training.schedule.forward_backward for pipelines")
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
        raise ValueError(f"--global-batch-size: {args.global_batch_size} prompts must split into micro-batches of "
                         f"{args.micro_batch_size} prompts on {args.data_parallel_size} data-parallel ranks")


@dataclass
class SyntheticMicroBatch:
    """A tree micro-batch and the response mask of its global batch.

    Attributes:
        micro_batch: whole prompts' rollouts packed as one tree.
        mask: ``[R, width]`` response-token mask of the global batch (``width = max_len - 1``).
    """

    micro_batch: TreeMicroBatch
    mask: torch.Tensor


def tree_micro_batches(args, dp_rank: int, dp_size: int) -> Iterator[SyntheticMicroBatch]:
    """Endless micro-batches of this data-parallel rank, one global batch per step.

    A step draws ``--global-batch-size`` prompts (seed: ``--seed`` + step); rank ``d``
    takes the contiguous block ``d`` of ``global / dp_size`` prompts and packs each run of
    ``--micro-batch-size`` prompts (all their rollouts) into one tree.
    """
    vocab = args.vocab_size or args.padded_vocab_size
    per_rank = args.global_batch_size // dp_size
    step = 0
    while True:
        batch = branching_rollouts([args.branch_prompt_length] * args.global_batch_size, args.branch_fanout,
                                   args.branch_segment_lengths, vocab_size=vocab, seed=args.seed + step)
        mask = response_mask(batch.lengths, batch.prompt_lengths)  # [R, width]
        width = mask.shape[1]
        group = torch.tensor(batch.group)
        for first in range(dp_rank * per_rank, (dp_rank + 1) * per_rank, args.micro_batch_size):
            ids = ((group >= first) & (group < first + args.micro_batch_size)).nonzero().flatten()
            tree = BranchTree.from_sequences([batch.sequences[int(i)] for i in ids], vocab_size=vocab)
            yield SyntheticMicroBatch(TreeMicroBatch(tree, ids, width), mask)
        step += 1


def train_valid_test_datasets_provider(num_samples):
    """Megatron-LM's dataset provider; with ``--dataloader-type external`` the returned
    iterables are the data iterators. No validation or test data."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    args = get_args()
    check_args(args)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    return tree_micro_batches(args, dp_rank, dp_size), None, None


train_valid_test_datasets_provider.is_distributed = True  # every rank builds its own iterator


def response_nll(lp: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor):
    """``(loss_sum, num_tokens)``: cross-entropy summed over the response tokens of the
    rollouts ``ids`` (``lp``: ``[r, width]``); Megatron divides by the global count."""
    m = mask[ids]
    return sft_loss(lp, m, global_tokens=1.0), m.sum()


def forward_step(data_iterator, model):
    """Megatron-LM's ``forward_step_func``: :func:`make_forward_step` for this micro-batch's
    loss (reported as the ``[loss_sum, num_tokens]`` pair Megatron-LM's ``training_log``
    averages over the global token count)."""
    item = next(data_iterator)
    return make_forward_step(partial(response_nll, mask=item.mask))(iter([item.micro_batch]), model)


def main() -> None:
    import inspect

    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    from megatron_branch.cpu import megatron_lm_on_cpu

    if "--calculate-per-token-loss" not in sys.argv:
        sys.argv.append("--calculate-per-token-loss")
    with megatron_lm_on_cpu():
        if "cfg_container" in inspect.signature(pretrain).parameters:
            # core_v0.19.0 and later: arguments -> model config (``--spec`` imported into
            # ``GPTModelConfig.transformer_layer_spec``) -> config container; the model is
            # built from the config, without a model provider.
            from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
            from megatron.training.arguments import parse_and_validate_args

            args = parse_and_validate_args(extra_args_provider=add_branch_args,
                                           args_defaults={"dataloader_type": "external"})
            config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
            pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
        else:  # core_v0.16.1: Megatron-LM's model provider and builder
            from gpt_builders import gpt_builder
            from model_provider import model_provider

            pretrain(
                train_valid_test_datasets_provider,
                partial(model_provider, gpt_builder),
                ModelType.encoder_or_decoder,
                forward_step,
                extra_args_provider=add_branch_args,
                args_defaults={"dataloader_type": "external"},
            )


if __name__ == "__main__":
    main()
