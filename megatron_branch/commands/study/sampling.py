"""Tree sampling for the study: shared response stems forked into tails.

Per prompt, ``stems`` response stems of ``stem_len`` tokens are sampled, and each is
forked into ``tails`` tails of ``tail_len`` tokens. Rollout ``r`` is
``(prompt p, stem s, tail j)`` with ``r = (p * stems + s) * tails + j``.

Each new token costs one packed forward of the branch-spec model over the *unique*
tokens of all current prefixes (the prompts are computed once, not once per rollout),
with logits only at each prefix's last token. There is no K/V cache; at these sizes that
is cheaper than the padded batch of :func:`megatron_branch.commands.synthetic.sample_continuations`.
Sampling is never timed in the study.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch
from torch import Tensor

from megatron_branch.scoring.output_rows import select_output_rows
from megatron_branch.scoring.unit import prepare_unit
from megatron_branch.tree import BranchTree


@dataclass
class TreeSample:
    """Rollouts of one step and their tree-sampling layout."""

    sequences: List[Tensor]
    prompt_len: int
    stem_len: int
    tail_len: int
    num_prompts: int
    stems: int
    tails: int

    @property
    def group_size(self) -> int:
        """Rollouts per prompt."""
        return self.stems * self.tails

    def prompt_of(self) -> Tensor:
        """``[R]`` prompt index of each rollout."""
        return torch.arange(len(self.sequences)) // self.group_size

    def stem_of(self) -> Tensor:
        """``[R]`` global stem index (prompt * stems + stem) of each rollout."""
        return torch.arange(len(self.sequences)) // self.tails


@torch.no_grad()
def next_tokens(model, seqs: Sequence[Tensor], generator: torch.Generator, vocab_size: int) -> Tensor:
    """``[n]`` one sampled next token per sequence, from one packed forward of their tree."""
    tree = BranchTree.from_sequences(list(seqs), vocab_size=vocab_size)
    last = tree.rows[torch.arange(tree.num_rollouts), tree.lengths - 1]  # [n] packed index of each end
    rows, inverse = torch.unique(last, return_inverse=True)  # equal prefixes share one row
    params, ids = prepare_unit(model, tree, 0, tree.unique_positions)
    with select_output_rows(model, rows):
        logits = model(ids.unsqueeze(0), params.positions.unsqueeze(0), attention_mask=None,
                       packed_seq_params=params)[0]  # [len(rows), V]
    probs = torch.softmax(logits.float()[inverse][:, :vocab_size], -1)  # [n, V]
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def extend(model, prefixes: Sequence[Tensor], length: int, generator: torch.Generator,
           vocab_size: int) -> List[Tensor]:
    """Sample ``length`` tokens after each prefix."""
    seqs = [p.clone() for p in prefixes]
    for _ in range(length):
        nxt = next_tokens(model, seqs, generator, vocab_size)
        seqs = [torch.cat([s, n.view(1)]) for s, n in zip(seqs, nxt)]
    return seqs


def sample_tree(model, prompts: Sequence[Tensor], stems: int, tails: int, stem_len: int, tail_len: int,
                generator: torch.Generator, vocab_size: int) -> TreeSample:
    """Tree sampling: ``stems`` stems per prompt, each forked into ``tails`` tails."""
    lengths = {int(p.numel()) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"prompts: all prompts must have one length, got {sorted(lengths)}")
    stem_seqs = extend(model, [p for p in prompts for _ in range(stems)], stem_len, generator, vocab_size)
    seqs = extend(model, [s for s in stem_seqs for _ in range(tails)], tail_len, generator, vocab_size)
    return TreeSample(seqs, lengths.pop(), stem_len, tail_len, len(prompts), stems, tails)
