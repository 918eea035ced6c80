"""GRPO on multi-turn agentic rollouts with a synthetic tool, trained by exact branch replay.

Each rollout is a prompt, then policy turns interleaved with tool results. After every
policy turn the tool answers ``[TOOL, f(x)]`` for the turn's last token ``x``
(``f(x) = 7x + 3 mod vocab``); the policy's task is to count up from whatever precedes each
of its tokens — so after a tool turn it must read the tool's output. Tree sampling forks
``--fanout`` samples at every policy turn (turns share their history), the tool's tokens
are context only (loss mask 0), and every policy turn gets its own GRPO advantage (its
accuracy, normalised within the prompt's group at the same turn). ``--naive`` computes the
same update with every rollout run in full; the two agree to float rounding.

    python examples/agentic_tool_grpo.py --steps 200 --plot results/agentic_reward.png
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch

warnings.filterwarnings("ignore")

from megatron_branch import enable_cpu, losses  # noqa: E402
from megatron_branch.agentic import Turn, assemble, group_turn_advantages  # noqa: E402
from megatron_branch.commands.plots import reward_curve  # noqa: E402
from megatron_branch.commands.synthetic import policy_update, sample_continuations  # noqa: E402
from megatron_branch.distributed import init_distributed  # noqa: E402
from megatron_branch.spec.builders import build_gpt, llama_config  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompts", type=int, default=4, help="prompts (groups) per step")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--policy-turns", type=int, default=3, help="policy turns per rollout (a tool turn between)")
    p.add_argument("--turn-len", type=int, default=4, help="tokens per policy turn")
    p.add_argument("--fanout", type=int, default=2, help="samples forked at every policy turn")
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--naive", action="store_true", help="every rollout in full (same update, slower)")
    p.add_argument("--plot", metavar="PNG", help="write the reward curve")
    p.add_argument("--log", metavar="JSON", help="write per-step reward, loss and gradient norm")
    return p.parse_args(argv)


def tool(x: int, vocab: int) -> list:
    """The tool's answer to a turn ending in ``x``: a marker and ``f(x)``."""
    return [vocab - 1, (7 * x + 3) % vocab]


def sample_rollouts(model, args, gen):
    """Tree-sampled multi-turn rollouts: ``fanout`` continuations of every policy turn."""
    frontier = [[Turn(torch.randint(0, args.vocab, (args.prompt_len,), generator=gen).tolist(), "prompt")]
                for _ in range(args.prompts)]
    for t in range(args.policy_turns):
        prefixes = [torch.tensor([x for turn in r for x in turn.tokens]) for r in frontier for _ in range(args.fanout)]
        grown = sample_continuations(model, prefixes, args.turn_len, gen, args.vocab)
        nxt = []
        for i, seq in enumerate(grown):
            turns = list(frontier[i // args.fanout]) + [Turn(seq[-args.turn_len:].tolist(), "policy")]
            if t < args.policy_turns - 1:
                turns.append(Turn(tool(int(seq[-1]), args.vocab), "tool"))
            nxt.append(turns)
        frontier = nxt
    return frontier


def turn_rewards(rollouts, args):
    """``[R, turns]``: each policy turn's count-up accuracy (0 for prompt and tool turns)."""
    out = torch.zeros(len(rollouts), max(len(r) for r in rollouts))
    for i, r in enumerate(rollouts):
        prev = r[0].tokens[-1]
        for t, turn in enumerate(r):
            if t == 0:
                continue
            if turn.role == "policy":
                hits = []
                for x in turn.tokens:
                    hits.append(float(x == (prev + 1) % args.vocab))
                    prev = x
                out[i, t] = sum(hits) / len(hits)
            else:
                prev = turn.tokens[-1]
    return out


def train(args, echo=print):
    enable_cpu()
    init_distributed()
    torch.manual_seed(args.seed)
    config = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2)
    model = build_gpt(config, args.vocab, seed=args.seed, max_sequence_length=256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    group = args.fanout ** args.policy_turns
    history = []
    start = time.perf_counter()
    for step in range(args.steps):
        rollouts = sample_rollouts(model, args, gen)
        batch = assemble(rollouts)
        rewards = turn_rewards(rollouts, args)
        adv = batch.token_advantages(group_turn_advantages(rewards, group))
        tree = batch.tree(vocab_size=args.vocab)
        mask = tree.rollout_loss_mask()  # the policy's tokens only
        tokens = mask.sum()

        def loss_fn(lp, ids):
            return losses.ppo_policy_loss(lp, lp.detach(), adv[ids], mask[ids], global_tokens=tokens)[0]

        loss_value, grad_norm, update_seconds = policy_update(model, optimizer, batch.sequences, loss_fn,
                                                             naive=args.naive, tree=tree, score_mask=mask)
        policy = rewards[:, 1::2]  # policy turns sit at odd turn indices
        history.append({"step": step, "reward": float(policy.mean()), "loss": loss_value, "grad_norm": grad_norm,
                        "update_seconds": update_seconds, "rollouts": len(rollouts),
                        "segments": len(tree.segments), "naive_positions": tree.naive_positions,
                        "unique_positions": tree.unique_positions})
        if step % 20 == 0 or step == args.steps - 1:
            echo(f"step {step:4d}  reward {policy.mean():.3f}  loss {loss_value:+.3e}  |grad| {grad_norm:.4e}  "
                 f"({time.perf_counter() - start:.0f}s)")
    total = sum(h["update_seconds"] for h in history)
    echo(f"{'naive' if args.naive else 'branch replay'} updates: {total:.1f} s over {args.steps} steps; "
         f"{history[-1]['rollouts']} rollouts, {history[-1]['segments']} segments per step")
    return history


def main(argv=None) -> int:
    args = parse_args(argv)
    history = train(args)
    if args.log:
        with open(args.log, "w") as f:
            json.dump(history, f)
    if args.plot:
        reward_curve(history, args.plot, "agentic GRPO (tool turns masked) + branch replay",
                     "policy-turn accuracy per step")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
