"""The study's training loop: one policy, one seed, four ways to compute the update.

For each experiment (``algo:task``) and seed, one tiny Llama-style policy is built and
copied once per mode; the modes then train **in lockstep** (step ``i`` of every mode, then
step ``i + 1``), each with its own optimizer and its own sampling generator seeded alike,
so machine-load noise hits all modes in the same window and the timing ratios stay fair.

Modes (:data:`MODES`):

* ``naive``: every rollout in full, right-padded causal micro-batches of
  ``naive_micro_batch`` rollouts (default: one batch) through the same model on torch's
  fused causal SDPA (:func:`megatron_branch.reference.naive.batched_rollout_logprobs`), one
  ``backward()`` per micro-batch;
* ``exact``: :func:`megatron_branch.replay_step`, one packed pass over the unique tokens;
* ``exact-streaming``: ``replay_step`` with ``max_chunk_tokens`` (stems cached, chunks of
  branches, exact stem backward);
* ``tail-only``: the same streaming with ``prefix_grad="detached"``: the stem units (the
  prompt and the shared response stems, and so the first token after each fork, whose
  logit sits at the stem's last position) are constants.

The chunk budget defaults to ``tails * tail_len``: a stem's tails fit one chunk while the
stem itself does not, so the shared response stem is a stem unit (what tail-only drops).

Timed (``seconds``): the update only — building the tree (replay modes), the forward of
old/reference log-probs when the algorithm needs them, every epoch's forward+backward and
optimizer step (``cpu_seconds``: the same spans in process CPU time). Not timed:
sampling, rewards, the gradient norm and the tail-only bias (the exact gradient at the same
weights, compared as :func:`megatron_branch.prefix_grad_bias` does).

**Exactness guard**: over the first ``guard_steps`` steps, ``exact`` and
``exact-streaming`` must match ``naive`` in reward, every epoch's loss and gradient norm
(``guard_rtol`` relative, fp32); otherwise :class:`StudyError` stops the study.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from megatron_branch.commands.progress import Progress
from megatron_branch.commands.study.algos import ALGOS, Prepared, StepLoss, get_algo
from megatron_branch.commands.study.sampling import sample_tree
from megatron_branch.commands.study.tasks import TASKS, get_task
from megatron_branch.cpu import enable_cpu
from megatron_branch.distributed import init_distributed
from megatron_branch.reference.naive import batched_rollout_logprobs
from megatron_branch.replay import plan_replay, replay_logprobs, replay_step
from megatron_branch.spec.builders import build_gpt, llama_config
from megatron_branch.tree import BranchTree

SCHEMA_VERSION = 1


class StudyError(RuntimeError):
    """The exactness guard failed: exact replay did not reproduce naive training."""


@dataclass(frozen=True)
class Mode:
    """How a mode computes the update: ``replay`` (else naive), with a chunk budget
    (``streaming``), and which prefix gradient."""

    name: str
    replay: bool
    streaming: bool = False
    prefix_grad: str = "exact"


MODES: Dict[str, Mode] = {m.name: m for m in (
    Mode("naive", replay=False),
    Mode("exact", replay=True),
    Mode("exact-streaming", replay=True, streaming=True),
    Mode("tail-only", replay=True, streaming=True, prefix_grad="detached"),
)}
EXACT_MODES = ("exact", "exact-streaming")


@dataclass
class StudyConfig:
    """What the study trains. :meth:`quick` is the test-suite setting (< 3 min on 2 cores)."""

    experiments: List[str] = field(default_factory=lambda: ["grpo:count-up", "grpo:opener", "ppo:opener",
                                                            "dpo:count-up"])
    """``algo:task`` pairs (algos: grpo, ppo, dpo; tasks: count-up, opener)."""
    modes: List[str] = field(default_factory=lambda: list(MODES))
    """Subset of :data:`MODES`; the guard needs ``naive`` and an exact mode."""
    seeds: List[int] = field(default_factory=lambda: [0, 1, 2])
    steps: int = 80
    """Sampling steps per run (PPO makes ``ppo_epochs`` optimizer updates per step)."""
    prompts: int = 4
    """Prompts per step."""
    prompt_len: int = 96
    stems: int = 2
    """Response stems per prompt (DPO: one)."""
    tails: int = 4
    """Tails per stem (DPO: 2, a pair)."""
    stem_len: int = 3
    tail_len: int = 6
    vocab_size: int = 16
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    lr: float = 3e-3
    """AdamW learning rate."""
    lr_by_algo: Dict[str, float] = field(default_factory=lambda: {"ppo": 2e-3})
    """Per-algorithm learning rates over ``lr`` (PPO makes ``ppo_epochs`` updates per batch;
    at 3e-3 one PPO seed collapsed after converging, in a tuning run)."""
    max_grad_norm: Optional[float] = 1.0
    """Gradient clipping before each optimizer step (timed; None: off)."""
    chunk_tokens: Optional[int] = None
    """Streaming budget (exact-streaming, tail-only); None: ``tails * tail_len``."""
    clip_ratio: float = 0.2
    ppo_epochs: int = 2
    dpo_beta: float = 0.1
    dpo_prompts: int = 8
    """DPO prompts per step: one stem each, forked into one pair (pairs with a stem in common
    would interleave their tails in the tree; a pair must fit one chunk)."""
    guard_steps: int = 3
    """Steps over which naive and exact must agree."""
    guard_rtol: float = 1e-5
    naive_micro_batch: Optional[int] = None
    """Rollouts per naive micro-batch (whole DPO pairs; gradient accumulation); None: all
    rollouts in one batch. The fair naive is the fastest size on the machine at hand."""
    threshold: float = 0.6
    """Reward threshold for the summary's steps/seconds to reach it."""
    threads: Optional[int] = 1
    """torch threads for the study (None: torch's default). One by default: the steps are
    small, and on a shared 2-core machine two OpenMP threads spin at barriers whenever the
    other core is busy, which made update times swing 10-50x; with one thread wall-clock and
    CPU time agree and the modes' ratios are stable."""

    def __post_init__(self):
        bad_modes = [m for m in self.modes if m not in MODES]
        if bad_modes:
            raise ValueError(f"modes: {bad_modes} not in {tuple(MODES)}")
        for exp in self.experiments:
            algo, _, task = exp.partition(":")
            if algo not in ALGOS or task not in TASKS:
                raise ValueError(f"experiments: {exp!r} is not ALGO:TASK with ALGO in {tuple(ALGOS)} and TASK in "
                                 f"{tuple(TASKS)}")
        for name in ("steps", "prompts", "prompt_len", "stems", "tails", "stem_len", "tail_len", "ppo_epochs",
                     "dpo_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.prompt_len < 2:
            raise ValueError(f"prompt_len: must be >= 2 (the opener task ends prompts with a separator), "
                             f"got {self.prompt_len}")
        if self.chunk_tokens is not None and self.chunk_tokens < 2 * self.tail_len:
            raise ValueError(f"chunk_tokens: must hold a DPO pair's two tails (>= {2 * self.tail_len}), "
                             f"got {self.chunk_tokens}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: must be >= 1 (or None for torch's default), got {self.threads}")
        if self.naive_micro_batch is not None and self.naive_micro_batch < 1:
            raise ValueError(f"naive_micro_batch: must be a positive number of rollouts, got {self.naive_micro_batch}")
        if not self.seeds:
            raise ValueError("seeds: at least one seed")

    @classmethod
    def quick(cls) -> "StudyConfig":
        return cls(seeds=[0], steps=4, prompts=2, prompt_len=48, hidden_size=32, num_attention_heads=2,
                   num_query_groups=1, tail_len=4, dpo_prompts=3, guard_steps=2)

    def budget(self, tails: int) -> int:
        return self.chunk_tokens or tails * self.tail_len


# ------------------------------------------------------------------------------ records
@dataclass
class RunRecord:
    """Per-step series of one (algo, task, mode, seed) run. Lists have one entry per step;
    ``loss`` and ``grad_norm`` are the means over the step's epochs (all epochs in
    ``*_epochs``), ``bias_*`` are filled for tail-only runs only."""

    algo: str
    task: str
    mode: str
    seed: int
    chunk_tokens: Optional[int]
    reward: List[float] = field(default_factory=list)
    reward_stem: List[float] = field(default_factory=list)
    reward_tail: List[float] = field(default_factory=list)
    loss: List[float] = field(default_factory=list)
    grad_norm: List[float] = field(default_factory=list)
    loss_epochs: List[List[float]] = field(default_factory=list)
    grad_norm_epochs: List[List[float]] = field(default_factory=list)
    bias_cosine: List[Optional[float]] = field(default_factory=list)
    bias_rel_norm: List[Optional[float]] = field(default_factory=list)
    bias_rel_error: List[Optional[float]] = field(default_factory=list)
    seconds: List[float] = field(default_factory=list)
    cpu_seconds: List[float] = field(default_factory=list)
    sample_seconds: List[float] = field(default_factory=list)
    positions_forward: List[int] = field(default_factory=list)
    positions_backward: List[int] = field(default_factory=list)
    naive_positions: List[int] = field(default_factory=list)
    unique_positions: List[int] = field(default_factory=list)
    dpo_accuracy: List[Optional[float]] = field(default_factory=list)
    dpo_margin: List[Optional[float]] = field(default_factory=list)
    dpo_pairs: List[int] = field(default_factory=list)
    clip_frac: List[Optional[float]] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class _State:
    mode: Mode
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    record: RunRecord


# -------------------------------------------------------------------------------- modes
def _budget(mode: Mode, cfg: StudyConfig, tails: int) -> Optional[int]:
    return cfg.budget(tails) if mode.streaming else None


def _naive_micro_batches(prep: Prepared, size: Optional[int]) -> List[Tensor]:
    """Rollout ids of the naive micro-batches: whole groups (DPO pairs) in order, at most
    ``size`` rollouts each unless one group is larger (``None``: one batch)."""
    num = len(prep.sequences)
    if size is None or size >= num:
        return [torch.arange(num)]
    groups: Dict[int, List[int]] = {}
    for r, g in enumerate(prep.group_ids if prep.group_ids is not None else range(num)):
        groups.setdefault(g, []).append(r)
    batches, current = [], []
    for members in groups.values():
        if current and len(current) + len(members) > size:
            batches.append(current)
            current = []
        current = current + members
    return [torch.tensor(b) for b in batches + [current]]


def _naive_logprobs(model, prep: Prepared, ids: Tensor) -> Tensor:
    """``[len(ids), max_len - 1]`` log-probs of one naive micro-batch (fused causal SDPA,
    the tree path's kernel family), padded to the step's width."""
    width = max(s.numel() for s in prep.sequences) - 1
    lp = batched_rollout_logprobs(model, [prep.sequences[i] for i in ids.tolist()], fused_causal=True)
    return torch.nn.functional.pad(lp, (0, width - lp.shape[1]))


def _extra_logprobs(mode: Mode, model, prep: Prepared, tree: Optional[BranchTree], budget,
                    micro_batch: Optional[int]) -> Tuple[Tensor, int]:
    """Old/reference log-probs (forward only) and the positions that took."""
    with torch.no_grad():
        if not mode.replay:
            batches = _naive_micro_batches(prep, micro_batch)
            lp = torch.cat([_naive_logprobs(model, prep, ids) for ids in batches])[torch.cat(batches).argsort()]
            return lp * prep.score_mask, sum(s.numel() for s in prep.sequences)
        return (replay_logprobs(model, tree, max_chunk_tokens=budget, score_mask=prep.score_mask),
                tree.unique_positions)


def _backward(mode: Mode, model, prep: Prepared, tree: Optional[BranchTree], loss_fn: StepLoss,
              budget, micro_batch: Optional[int]) -> Tuple[float, int, int]:
    """Forward+backward of the step's loss; returns ``(loss, positions forward, backward)``."""
    if not mode.replay:
        total = 0.0
        for ids in _naive_micro_batches(prep, micro_batch):  # the loss is additive over rollouts
            loss = loss_fn(_naive_logprobs(model, prep, ids), ids)
            loss.backward()
            total += float(loss.detach())
        n = sum(s.numel() for s in prep.sequences)
        return total, n, n
    stats = replay_step(model, tree, loss_fn, max_chunk_tokens=budget, prefix_grad=mode.prefix_grad,
                        group_ids=prep.group_ids, score_mask=prep.score_mask)
    backward = stats.unique_positions
    if mode.prefix_grad == "detached":
        backward -= sum(op.end - op.start for op in plan_replay(tree, budget, prep.group_ids) if op.kind == "stem")
    return stats.loss, stats.positions_forwarded, backward


def _flat_grads(model) -> Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in model.parameters()])


def gradient_bias(model, tree: BranchTree, loss_fn: StepLoss, prep: Prepared) -> Dict[str, Optional[float]]:
    """Tail-only's gradient (in ``.grad`` now) against the exact one at the same weights.

    The numbers of :func:`megatron_branch.prefix_grad_bias` (``cosine``, ``rel_norm``,
    ``rel_error``), but the tail-only gradient is the one the update already computed, and
    the exact one comes from a single packed pass (the exact gradient does not depend on the
    chunking), so the measurement costs one exact backward instead of two streaming ones.
    ``.grad`` is left as it was. All three are None when the exact gradient is zero.
    """
    detached = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    flat_detached = _flat_grads(model)
    for p in model.parameters():
        p.grad = None
    replay_step(model, tree, loss_fn, group_ids=prep.group_ids, score_mask=prep.score_mask)
    exact = _flat_grads(model)
    for p, g in zip(model.parameters(), detached):
        p.grad = g
    norm = float(exact.norm())
    if norm == 0.0:  # nothing to learn this step (e.g. every group's rewards tie): undefined
        return {"cosine": None, "rel_norm": None, "rel_error": None}
    cosine = float(torch.nn.functional.cosine_similarity(exact, flat_detached, dim=0)) \
        if float(flat_detached.norm()) > 0 else 0.0
    return {"cosine": cosine, "rel_norm": float(flat_detached.norm()) / norm,
            "rel_error": float((flat_detached - exact).norm()) / norm}


def _grad_norm(model) -> float:
    grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
    return float(torch.cat(grads).norm()) if grads else 0.0


def _record_skip(rec: RunRecord, mode: Mode) -> None:
    """A step without an update: zero cost, no loss or bias."""
    for series in (rec.loss, rec.grad_norm, rec.seconds, rec.cpu_seconds):
        series.append(0.0)
    rec.loss_epochs.append([])
    rec.grad_norm_epochs.append([])
    for series in (rec.positions_forward, rec.positions_backward, rec.naive_positions, rec.unique_positions):
        series.append(0)
    for series in (rec.dpo_accuracy, rec.dpo_margin, rec.clip_frac):
        series.append(None)
    if mode.prefix_grad == "detached":
        for series in (rec.bias_cosine, rec.bias_rel_norm, rec.bias_rel_error):
            series.append(None)


def _step(state: _State, cfg: StudyConfig, algo, task, ref_model, prompts: int, stems: int, tails: int) -> None:
    """One sampling step and its update(s) for one mode; appends to ``state.record``."""
    rec, mode, model = state.record, state.mode, state.model
    t0 = time.perf_counter()
    prompt_ids = task.prompts(prompts, cfg.prompt_len, cfg.vocab_size, state.generator)
    sample = sample_tree(model, prompt_ids, stems, tails, cfg.stem_len, cfg.tail_len, state.generator, cfg.vocab_size)
    rec.sample_seconds.append(time.perf_counter() - t0)
    rewards, parts = task.rewards(sample.sequences, sample.prompt_len, cfg.stem_len, cfg.vocab_size)
    rec.reward.append(parts["reward"])
    rec.reward_stem.append(parts["reward_stem"])
    rec.reward_tail.append(parts["reward_tail"])
    prep = algo.prepare(sample, rewards, cfg)
    rec.dpo_pairs.append(int(prep.info.get("dpo_pairs", 0)))
    budget = _budget(mode, cfg, tails)
    if not prep.sequences:  # DPO with every pair tied: nothing to learn this step
        _record_skip(rec, mode)
        return

    seconds, cpu_seconds, fwd, bwd = 0.0, 0.0, 0, 0
    start, cpu = time.perf_counter(), time.process_time()
    tree = BranchTree.from_sequences(prep.sequences, vocab_size=cfg.vocab_size) if mode.replay else None
    extra = None
    if prep.needs is not None:
        extra, n = _extra_logprobs(mode, model if prep.needs == "old" else ref_model, prep, tree, budget,
                                   cfg.naive_micro_batch)
        fwd += n
    seconds += time.perf_counter() - start
    cpu_seconds += time.process_time() - cpu
    loss_fn = prep.make_loss(extra)
    losses_, norms, metrics = [], [], {}
    for epoch in range(prep.epochs):
        state.optimizer.zero_grad(set_to_none=True)
        loss_fn.reset()
        start, cpu = time.perf_counter(), time.process_time()
        loss, f, b = _backward(mode, model, prep, tree, loss_fn, budget, cfg.naive_micro_batch)
        seconds += time.perf_counter() - start
        cpu_seconds += time.process_time() - cpu
        fwd, bwd = fwd + f, bwd + b
        if epoch == 0:
            metrics = loss_fn.summary()
            if mode.prefix_grad == "detached":  # untimed: the exact gradient at the same weights
                bias = gradient_bias(model, tree, loss_fn, prep)
                rec.bias_cosine.append(bias["cosine"])
                rec.bias_rel_norm.append(bias["rel_norm"])
                rec.bias_rel_error.append(bias["rel_error"])
        norms.append(_grad_norm(model))
        losses_.append(loss)
        start, cpu = time.perf_counter(), time.process_time()
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        state.optimizer.step()
        seconds += time.perf_counter() - start
        cpu_seconds += time.process_time() - cpu
    rec.loss.append(sum(losses_) / len(losses_))
    rec.grad_norm.append(sum(norms) / len(norms))
    rec.loss_epochs.append(losses_)
    rec.grad_norm_epochs.append(norms)
    rec.seconds.append(seconds)
    rec.cpu_seconds.append(cpu_seconds)
    rec.positions_forward.append(fwd)
    rec.positions_backward.append(bwd)
    rec.naive_positions.append(sum(s.numel() for s in prep.sequences))
    rec.unique_positions.append(BranchTree.from_sequences(prep.sequences).unique_positions if tree is None
                                else tree.unique_positions)
    rec.dpo_accuracy.append(metrics.get("dpo_accuracy"))
    rec.dpo_margin.append(metrics.get("dpo_margin"))
    rec.clip_frac.append(metrics.get("clip_frac"))


# -------------------------------------------------------------------------------- guard
def rel_diff(a: float, b: float, floor: float = 0.0) -> float:
    """``|a - b| / max(|a|, |b|, floor)`` (0 when that is 0)."""
    scale = max(abs(a), abs(b), floor)
    return abs(a - b) / scale if scale > 0 else 0.0


GUARD_FLOOR = 1e-2
"""Magnitude below which the guard compares absolutely (``rtol * GUARD_FLOOR``): on-policy
GRPO and PPO surrogates vanish by construction (advantages sum to zero in every group, so
the loss is ~1e-9 of fp32 round-off), where a relative difference means nothing. The
rewards, DPO losses and gradient norms here are 0.05-2, far above it."""


def check_exact(records: Dict[str, RunRecord], step: int, rtol: float) -> Dict[str, float]:
    """The exactness guard for ``step``: every exact mode against naive.

    Compares the reward, each epoch's loss and each epoch's gradient norm: a value passes
    when ``|a - b| <= rtol * max(|a|, |b|, GUARD_FLOOR)``.

    Returns:
        the worst ``rel_diff(a, b, GUARD_FLOOR)`` per metric (for the report).

    Raises:
        StudyError: a value differs; the message names the run, step and metric.
    """
    naive = records["naive"]
    worst: Dict[str, float] = {}
    for name in EXACT_MODES:
        if name not in records:
            continue
        rec = records[name]
        pairs = [("reward", naive.reward[step], rec.reward[step])]
        if len(naive.loss_epochs[step]) != len(rec.loss_epochs[step]):
            raise StudyError(f"exactness guard: {rec.algo}:{rec.task} seed {rec.seed} step {step}: naive made "
                             f"{len(naive.loss_epochs[step])} updates, {name} {len(rec.loss_epochs[step])}")
        for e, (a, b) in enumerate(zip(naive.loss_epochs[step], rec.loss_epochs[step])):
            pairs.append((f"loss[epoch {e}]", a, b))
        for e, (a, b) in enumerate(zip(naive.grad_norm_epochs[step], rec.grad_norm_epochs[step])):
            pairs.append((f"grad_norm[epoch {e}]", a, b))
        for metric, a, b in pairs:
            diff = rel_diff(a, b, GUARD_FLOOR)
            if not (math.isfinite(a) and math.isfinite(b)) or diff > rtol:
                raise StudyError(
                    f"exactness guard: {rec.algo}:{rec.task} seed {rec.seed} step {step}: {metric} naive {a!r} vs "
                    f"{name} {b!r} (rel diff {diff:.2e} > {rtol:g}); branch replay no longer reproduces "
                    f"per-rollout training")
            key = metric.split("[")[0]
            worst[key] = max(worst.get(key, 0.0), diff)
    return worst


# ---------------------------------------------------------------------------------- run
def _model_config(cfg: StudyConfig):
    return llama_config(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups)


def run_experiment(cfg: StudyConfig, experiment: str, seed: int, on_step: Optional[Callable[[str], None]] = None,
                   guard: Optional[Dict[str, float]] = None) -> List[RunRecord]:
    """All modes of ``experiment`` (``algo:task``) for one seed, in lockstep."""
    algo_name, _, task_name = experiment.partition(":")
    algo, task = get_algo(algo_name), get_task(task_name)
    tails = algo.tails or cfg.tails
    stems, prompts = (1, cfg.dpo_prompts) if algo_name == "dpo" else (cfg.stems, cfg.prompts)
    config = _model_config(cfg)
    max_len = cfg.prompt_len + cfg.stem_len + cfg.tail_len
    base = build_gpt(config, cfg.vocab_size, seed=seed, max_sequence_length=max_len)
    ref_model = base if algo_name == "dpo" else None  # frozen initial policy (never stepped)
    states: Dict[str, _State] = {}
    for name in cfg.modes:
        model = build_gpt(config, cfg.vocab_size, max_sequence_length=max_len)
        model.load_state_dict(base.state_dict())
        mode = MODES[name]
        states[name] = _State(
            mode, model, torch.optim.AdamW(model.parameters(), lr=cfg.lr_by_algo.get(algo_name, cfg.lr)),
            torch.Generator().manual_seed(seed),
            RunRecord(algo_name, task_name, name, seed, _budget(mode, cfg, tails)),
        )
    records = {name: s.record for name, s in states.items()}
    can_guard = "naive" in records and any(m in records for m in EXACT_MODES)
    for step in range(cfg.steps):
        for state in states.values():
            _step(state, cfg, algo, task, ref_model, prompts, stems, tails)
        if can_guard and step < cfg.guard_steps:
            worst = check_exact(records, step, cfg.guard_rtol)
            if guard is not None:
                for k, v in worst.items():
                    guard[k] = max(guard.get(k, 0.0), v)
        if on_step:
            rewards = " ".join(f"{n}={r.reward[-1]:.2f}" for n, r in records.items())
            on_step(f"{experiment} s{seed} {rewards}")
    return list(records.values())


def _versions() -> dict:
    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # noqa: BLE001 - informational only
        mcore = "unknown"
    return {"torch": torch.__version__, "megatron_core": mcore, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.machine()}


def run_study(cfg: StudyConfig, echo: Callable[[str], None] = print, progress: bool = True,
              verbose: bool = False) -> dict:
    """Every experiment x seed x mode; returns ``{"runs": [...], "guard": ..., "config": ...}``.

    ``progress`` shows a bar on a terminal and plain lines elsewhere; ``verbose`` the bar
    wherever stderr goes (:class:`megatron_branch.commands.progress.Progress`).

    Raises:
        StudyError: the exactness guard failed.
    """
    enable_cpu()
    init_distributed()
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    environment = _versions()
    guard: Dict[str, float] = {}
    runs: List[RunRecord] = []
    total = len(cfg.experiments) * len(cfg.seeds) * cfg.steps
    bar = Progress(total, "study", verbose=verbose) if progress else None
    start = time.perf_counter()
    try:
        for experiment in cfg.experiments:
            for seed in cfg.seeds:
                recs = run_experiment(cfg, experiment, seed, on_step=bar.update if bar else None, guard=guard)
                runs.extend(recs)
                if bar:
                    bar.end_line()
                naive = next((r for r in recs if r.mode == "naive"), None)
                parts = []
                for r in recs:
                    med = statistics.median(r.seconds)
                    speed = f" ({statistics.median(naive.seconds) / med:.2f}x)" if naive and med > 0 else ""
                    tail = max(1, len(r.reward) // 10)
                    parts.append(f"{r.mode} reward {sum(r.reward[-tail:]) / tail:.2f} update {med * 1e3:.0f} ms"
                                 f"{speed}")
                echo(f"{experiment} seed {seed}: " + "; ".join(parts))
    finally:
        torch.set_num_threads(threads)
        if bar:
            bar.__exit__(None, None, None)
    return {
        "schema_version": SCHEMA_VERSION,
        "config": asdict(cfg),
        "environment": environment,
        "total_seconds": time.perf_counter() - start,
        "guard": {"steps": cfg.guard_steps if "naive" in cfg.modes else 0, "rtol": cfg.guard_rtol,
                  "floor": GUARD_FLOOR,
                  "modes": [m for m in EXACT_MODES if m in cfg.modes], "worst_rel_diff": guard, "passed": True},
        "runs": [r.to_json() for r in runs],
    }
