"""``BranchMegatronEngine``: verl 0.9.1's Megatron LM-head engine with branch replay.

verl's ``MegatronEngineWithLMHead`` runs every rollout of a micro-batch in full (THD
packed). This subclass keeps everything verl does around a micro-batch — its data flow,
its ``postprocess_micro_batch_func``, its ``ppo_loss`` and the reductions — and replaces
the one step that computes the log-probs: :meth:`forward_step` builds the prefix tree of
the micro-batch's sequences and computes every unique position once
(:func:`megatron_branch.packed_logprobs`, the sampling ``temperature`` of each sample),
returning verl's layout: jagged ``log_probs`` (and ``entropy``) ``[B, L_i]`` with
``lp[t] = log p(x[t + 1] | x[<= t])``. The last position predicts past the sequence:
verl's own forward fills it with the next packed sequence's score (and that prediction's
entropy), its loss never reads it; here both are 0.

Around it: micro-batches keep every ``uid`` group whole and no micro-batch computes more
than ``max_token_len_per_gpu`` unique tokens
(:func:`megatron_branch.integrations.verl.micro_batches.group_micro_batches`, in place of
verl's ``prepare_micro_batches`` for the duration of :meth:`forward_backward_batch`); the
branch layer spec goes into whichever bridge verl builds the model with
(:mod:`megatron_branch.integrations.verl.bridges`: Megatron-Bridge's provider or the vanilla
``mbridge`` bridge); :meth:`initialize` checks the configuration before verl builds anything,
checks the built model and logs that branch replay is active; every
:meth:`forward_backward_batch` adds ``branch/naive_tokens``, ``branch/unique_tokens``,
``branch/share_ratio`` and ``branch/split_groups`` to verl's metrics (with a logged warning
when groups arrive split); an optional run-time exactness check
(``MEGATRON_BRANCH_VERIFY_EVERY``) reports ``branch/max_logprob_diff``.

The engine config chooses the tree-attention kernel and a streaming budget under
``megatron.override_mcore_model_config.branch`` (``kernel``, ``max_chunk_tokens``;
:func:`megatron_branch.integrations.options.verl_branch_options`), checked when the model
is built and logged once. The budget applies to forward-only passes without entropy
(verl's reference log-probs): :func:`megatron_branch.replay_logprobs` streams the
micro-batch's tree in forwards of at most that many tokens. A pass that needs gradients or
entropy runs one forward per micro-batch (verl's ``*_max_token_len_per_gpu`` bounds it).

Rollout routing replay (``megatron.router_replay.mode=R3``): the experts verl's rollout
recorded (``routed_experts``, jagged ``[B, L_i, layers, topk]``) are cut per sequence
(:func:`rollout_routing`: MoE layers only, unrecorded last rows filled) and replayed
by the package (``routing=``), one routing per unique token; verl's own replay patch stays
off for this engine (:func:`_verl_replay_patch_off`). R2 (record in the old-log-prob pass,
replay in the update) is refused.

What cannot be exact is refused with the verl option named (:func:`check_config`,
:func:`check_micro_batch`): fused kernels, BSHD (no remove-padding), MTP, router replay R2
(and R3 with ``moe_router_fusion``), dynamic CP, pipeline and context parallelism (not
supported by this adapter yet), Megatron-Bridge with ``attention_backend=local``,
multi-modal inputs, distillation, Σπ² outputs, value heads.
"""

from __future__ import annotations

import contextlib
import logging
import os
from functools import partial
from typing import Iterator, List, Optional

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.megatron import transformer_impl
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

from megatron_branch._megatron import RouterReplay, TopKRouter
from megatron_branch.integrations.options import (
    BranchOptions,
    describe_budget,
    describe_kernel,
    log_once,
    verl_branch_options,
)
from megatron_branch.integrations.verl.bridges import check_branch_model, hook_mbridge, hook_provider
from megatron_branch.integrations.verl.micro_batches import SharingStats, batch_uids, group_micro_batches
from megatron_branch.layout import ParallelLayout
from megatron_branch.replay.step import replay_logprobs
from megatron_branch.scoring.packed import packed_logprobs
from megatron_branch.spec.moe.routing_replay import check_routing_model, moe_layer_columns
from megatron_branch.training.runtime_check import ExactnessCheck, sample_rollouts
from megatron_branch.tree import BranchTree

logger = logging.getLogger(__name__)

VENDOR = "branch"  # verl selects this engine with VERL_ENGINE_VENDOR=branch
VERIFY_EVERY_ENV = "MEGATRON_BRANCH_VERIFY_EVERY"
VERIFY_TOLERANCE_ENV = "MEGATRON_BRANCH_VERIFY_TOLERANCE"


def _flag(obj, name: str, default=None):
    return getattr(obj, name, default) if obj is not None else default


def _attention_backend(engine_config) -> str:
    """``override_transformer_config.attention_backend`` as a lower-case name ('' when unset)."""
    overrides = _flag(engine_config, "override_transformer_config") or {}
    value = overrides.get("attention_backend") if hasattr(overrides, "get") else None
    return str(getattr(value, "name", value) or "").lower()


def _router_replay_mode(engine_config) -> str:
    """``megatron.router_replay.mode`` ('disabled' when unset)."""
    mode = _flag(_flag(engine_config, "router_replay"), "mode", None)
    return "disabled" if mode in (None, "none", "disabled") else str(mode)


def _override(engine_config, key: str):
    overrides = _flag(engine_config, "override_transformer_config") or {}
    return overrides.get(key) if hasattr(overrides, "get") else None


def check_config(engine_config, model_config) -> None:
    """Refuse verl settings branch replay cannot compute exactly, naming the option.

    Raises:
        ValueError: the first such setting.
    """
    refuse = [
        (_flag(engine_config, "use_fused_kernels", False), "actor_rollout_ref.model.use_fused_kernels=True",
         "fused log-prob kernels compute verl's own forward"),
        (not _flag(engine_config, "use_remove_padding", True), "actor_rollout_ref.model.use_remove_padding=False",
         "the padded BSHD path is not a packed batch of whole sequences"),
        (_flag(engine_config, "dynamic_context_parallel", False), "megatron.dynamic_context_parallel=True",
         "dynamic CP reshards micro-batches across ranks"),
        ((_flag(engine_config, "context_parallel_size", 1) or 1) > 1, "megatron.context_parallel_size > 1",
         "context parallelism for trees is not wired into this adapter yet"),
        ((_flag(engine_config, "pipeline_model_parallel_size", 1) or 1) > 1,
         "megatron.pipeline_model_parallel_size > 1",
         "pipeline stages would exchange tree activations this adapter does not send yet"),
        (_router_replay_mode(engine_config) not in ("disabled", "R3"),
         f"megatron.router_replay.mode={_router_replay_mode(engine_config)}",
         "R2 records routes in the old-log-prob pass and replays them in the update, which would need a record "
         "path mapping the prefix tree back to rollouts; R3 (the rollout's own routes) is supported"),
        (_router_replay_mode(engine_config) == "R3" and bool(_override(engine_config, "moe_router_fusion")),
         "megatron.override_transformer_config.moe_router_fusion=True",
         "with router_replay.mode=R3 the fused top-k kernel bypasses Megatron's RouterReplay: set it to False"),
        (_router_replay_mode(engine_config) == "R3" and _override(engine_config, "moe_enable_routing_replay")
         is not None and not _override(engine_config, "moe_enable_routing_replay"),
         "megatron.override_transformer_config.moe_enable_routing_replay=False",
         "router_replay.mode=R3 needs routers built with Megatron's RouterReplay: set it to True (or leave it "
         "unset; verl sets it)"),
        (_flag(_flag(model_config, "mtp"), "enable", False), "actor_rollout_ref.model.mtp.enable=True",
         "multi-token prediction layers are built from Megatron's stock specs"),
        (_attention_backend(engine_config) == "local" and not _flag(engine_config, "vanilla_mbridge", False),
         "megatron.override_transformer_config.attention_backend=local",
         "Megatron-Bridge then puts Megatron's stock DotProductAttention beside the branch self-attention"),
        (_flag(engine_config, "pad_to_length", False), "megatron.pad_to_length=True",
         "bucketed padding changes verl's packed layout"),
        (_flag(model_config, "model_type", "language_model") == "value_model", "critic (value model)",
         "a value head has no log-probs to share"),
        (hasattr(_flag(model_config, "hf_config"), "vision_config"), "a vision-language model",
         "multi-modal inputs are not token sequences a prefix tree can share"),
    ]
    for bad, option, why in refuse:
        if bad:
            raise ValueError(f"{option}: not supported by megatron_branch's verl engine ({why}); use verl's stock "
                             "engine (unset VERL_ENGINE_VENDOR)")


def check_micro_batch(batch: TensorDict) -> None:
    """Refuse per-batch options that cannot be exact, naming the key."""
    for key in ("distillation_use_topk", "distillation_only", "calculate_sum_pi_squared", "record_r2_routes"):
        if tu.get_non_tensor_data(batch, key=key, default=False):
            raise ValueError(f"{key}: not supported by megatron_branch's verl engine; use verl's stock engine")
    if "multi_modal_inputs" in batch.keys():
        raise ValueError("multi_modal_inputs: multi-modal batches are not supported by megatron_branch's verl engine")
    if not batch["input_ids"].is_nested:
        raise ValueError("input_ids: megatron_branch's verl engine takes verl's jagged (no-padding) micro-batches")


# ---------------------------------------------------------------------------- rollout routing replay (R3)
def moe_routers(model) -> list:
    """The MoE routers of ``model``'s decoder (a Megatron ``TopKRouter`` each), in layer order."""
    found = [m for m in getattr(model, "decoder", model).modules() if isinstance(m, TopKRouter)]
    return sorted(found, key=lambda r: int(r.layer_number))


def _fill_last_rows(sequences: List[torch.Tensor], parts: List[torch.Tensor]) -> List[torch.Tensor]:
    """Each sequence's unrecorded routing rows filled: the last one (the rollout engine never
    forwards the last sampled token; verl pads its row with zeros; no log-prob of its sequence
    reads it) and, before it, trailing placeholder rows (all zeros with ``topk > 1``, which no
    top-k is: verl's agent loop zero-fills what the engine did not record, e.g. after a
    multi-turn loop's last generation). A filled row takes the row another sequence of the
    micro-batch recorded for the same token of the tree, else the previous row of its own
    sequence, so that rollouts sharing a token agree."""
    tree = BranchTree.from_sequences(sequences)
    lengths = [len(x) for x in sequences]
    rows = torch.cat([tree.rows[i, :n] for i, n in enumerate(lengths)]).to("cpu")  # packed index per position
    flat = torch.cat(parts)
    missing = torch.zeros(len(rows), dtype=torch.bool)
    start = 0
    for part, n in zip(parts, lengths):
        first = n - 1
        if part.shape[-1] > 1:
            zero = (part == 0).flatten(1).all(1)
            while first > 0 and bool(zero[first - 1]):
                first -= 1
        missing[start + first: start + n] = True
        start += n
    known = torch.zeros(tree.unique_positions, dtype=torch.bool)
    known[rows[~missing]] = True
    source = torch.full((tree.unique_positions,), -1, dtype=torch.long)
    source[rows[~missing]] = torch.nonzero(~missing)[:, 0]  # any recorded entry of each tree token
    out, start = [], 0
    for part, n in zip(parts, lengths):
        part = part.clone()
        for t in torch.nonzero(missing[start: start + n])[:, 0].tolist():
            token = int(rows[start + t])
            if bool(known[token]):
                part[t] = flat[int(source[token])]
            elif t > 0:
                part[t] = part[t - 1]
            else:  # a first token nobody recorded (it predicts nothing read here): any distinct experts
                part[t] = torch.arange(part.shape[-1], dtype=part.dtype)
        out.append(part)
        start += n
    return out


def rollout_routing(batch: TensorDict, routers: list, num_layers: int) -> List[torch.Tensor]:
    """The rollout's routes of a verl micro-batch, per sequence ``[L_i, moe_layers, topk]``
    (host), for ``routing=`` of :func:`megatron_branch.packed_logprobs`.

    verl's ``routed_experts`` is jagged ``[B, L_i, layers, topk]`` aligned with ``input_ids``
    (its rollout records every decoder layer, ``layers = num_layers``; only the MoE layers'
    columns are kept, at their routers' layer numbers; a tensor with the MoE layers only is
    taken as it is). A sequence with one row fewer than its tokens gets one; every last row
    and trailing zero rows are filled (:func:`_fill_last_rows`).

    Raises:
        ValueError: no ``routed_experts``, or one that does not match ``input_ids`` or the model's layers.
    """
    routed = batch.get("routed_experts", None) if "routed_experts" in batch.keys() else None
    if routed is None:
        raise ValueError("routed_experts: megatron.router_replay.mode=R3 replays the rollout's routes but the batch "
                         "has none (actor_rollout_ref.rollout.enable_rollout_routing_replay=True records them)")
    sequences = [s.to("cpu") for s in batch["input_ids"].unbind()]
    if not isinstance(routed, torch.Tensor) or not routed.is_nested or routed.dim() != 4 or \
            routed.size(0) != len(sequences):
        got = tuple(routed.shape) if isinstance(routed, torch.Tensor) and not routed.is_nested else type(routed)
        raise ValueError(f"routed_experts: expected verl's jagged [B, L_i, layers, topk] with B = {len(sequences)} "
                         f"(use_remove_padding=True), got {got}")
    numbers = [int(r.layer_number) for r in routers]
    parts = []
    for i, (seq, part) in enumerate(zip(sequences, routed.unbind())):
        part = part.to("cpu")
        if part.shape[0] == len(seq) - 1:
            part = torch.cat([part, part[-1:] if len(part) else part.new_zeros(1, *part.shape[1:])])
        if part.shape[0] != len(seq):
            raise ValueError(f"routed_experts: sample {i} has {part.shape[0]} rows for {len(seq)} tokens")
        if part.shape[1] == num_layers and num_layers != len(numbers):
            part = part[:, [n - 1 for n in numbers]]  # every decoder layer recorded: the MoE layers' columns
        elif part.shape[1] != len(numbers):
            raise ValueError(f"routed_experts: sample {i} has {part.shape[1]} layers; the model has {num_layers} "
                             f"decoder layers, {len(numbers)} of them MoE")
        parts.append(part.long() if part.dtype == torch.uint8 else part)
    return _fill_last_rows(sequences, parts)


@contextlib.contextmanager
def _verl_replay_patch_off():
    """Scoped: verl's ``MegatronEngine.__init__`` does not apply its router replay patch
    (``apply_router_replay_patch``: its own ``RouterReplay`` in every ``TopKRouter`` and its own
    routing), so the routers keep Megatron's ``RouterReplay``, which the package drives. A
    runtime patch of one module attribute, undone on exit; verl 0.9.1."""
    saved = transformer_impl.apply_router_replay_patch
    transformer_impl.apply_router_replay_patch = lambda: None
    try:
        yield
    finally:
        transformer_impl.apply_router_replay_patch = saved


def check_routing_routers(routers: list, config) -> None:
    """Raise unless ``routers`` (the built model's) can replay the rollout's routes with the
    package: Megatron's own ``RouterReplay`` in each (not verl's patched one: its actions are
    another enum, a replay would silently route natively)."""
    option = "megatron.router_replay.mode=R3"
    # verl's patched class first: the library's refusal of a foreign RouterReplay does not say why it is there
    foreign = [r for r in routers if RouterReplay is None or not isinstance(r.router_replay, RouterReplay)]
    if RouterReplay is not None and foreign:
        raise ValueError(f"{option}: the routers hold {type(foreign[0].router_replay).__module__}.RouterReplay (verl's "
                         "router replay patch, applied by another engine with router replay in this process), not "
                         "Megatron's, which megatron_branch replays through; build the branch engine in a process "
                         "where verl's stock engine with router_replay does not run")
    try:
        check_routing_model(routers, moe_layer_columns(routers), config)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def _temperatures(batch: TensorDict, num: int) -> torch.Tensor:
    value = batch["temperature"]
    if isinstance(value, torch.Tensor):
        per = value.reshape(-1).float()
        if per.numel() != num:
            raise ValueError(f"temperature: {per.numel()} values for {num} samples")
    else:
        per = torch.full((num,), float(value))
    # verl's processor turns non-positive temperatures into 1e-8; the package refuses them
    return per


def _streamed_logprobs(model, values: torch.Tensor, offsets: torch.Tensor, temps: torch.Tensor,
                       max_chunk_tokens: int, routing: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
    """Forward-only log-probs of the packed sequences ``values`` (``offsets [B + 1]``) in
    verl's flat layout, by streaming replay of their tree: ``lp[t] = log p(x[t + 1] | <= t)``
    within each sequence, 0 at its last token."""
    bounds = offsets.to("cpu")
    flat = values.detach().to("cpu")
    tree = BranchTree.from_sequences([flat[int(a):int(b)] for a, b in zip(bounds[:-1], bounds[1:])])
    lp = replay_logprobs(model, tree, max_chunk_tokens=max_chunk_tokens, temperature=temps,
                         routing=routing)  # [B, max_len - 1]
    t = torch.arange(lp.shape[1])
    valid = t[None, :] < (bounds.diff() - 1)[:, None]
    where = (bounds[:-1, None] + t[None, :])[valid]
    out = lp.new_zeros(int(bounds[-1]))
    out[where.to(out.device)] = lp[valid.to(lp.device)]
    return out


@EngineRegistry.register(model_type="language_model", backend="megatron", device="cuda", vendor=VENDOR)
class BranchMegatronEngine(MegatronEngineWithLMHead):
    """verl's Megatron LM-head engine whose micro-batch forward is branch replay."""

    verify: Optional[ExactnessCheck] = None
    branch_options: Optional[BranchOptions] = None
    split_warned: bool = False  # the split-groups warning was logged

    def _options(self) -> BranchOptions:
        """The engine config's kernel and budget (checked, logged once)."""
        if self.branch_options is None:
            options = verl_branch_options(self.engine_config)
            log_once(f"megatron_branch verl engine: tree-attention kernel {describe_kernel(options.kernel)}; "
                     f"forward-only log-probs without entropy: {describe_budget(options.max_chunk_tokens)} "
                     "(megatron.override_mcore_model_config.branch)")
            self.branch_options = options
        return self.branch_options

    # ------------------------------------------------------------------ model build
    def __init__(self, *args, **kwargs):
        with _verl_replay_patch_off():  # R3 goes through the package (Megatron's RouterReplay), not verl's patch
            super().__init__(*args, **kwargs)

    def _replays_routes(self) -> bool:
        return _router_replay_mode(self.engine_config) == "R3"

    def initialize(self):
        """verl's ``initialize``, with the configuration checked first (a ``ValueError`` naming
        the verl option, before anything is built), the built model checked for tree attention
        in every layer, and a log line saying that branch replay is active."""
        check_config(self.engine_config, self.model_config)
        self._options()
        super().initialize()
        check_branch_model(self.module)
        if self._replays_routes():
            check_routing_routers(moe_routers(self.module[0]), self.tf_config)
        # verl's loggers default to WARN: logged at that level so that every run shows which engine ran
        logger.warning("megatron_branch: branch replay is active in verl's %s engine (%s; kernel %s; "
                       "VERL_ENGINE_VENDOR=%s); per-step sharing in the branch/* metrics",
                       "reference" if self.engine_config.forward_only else "training",
                       "vanilla mbridge" if self.engine_config.vanilla_mbridge else "Megatron-Bridge",
                       describe_kernel(self.branch_options.kernel), VENDOR)

    def _build_tf_config(self):
        check_config(self.engine_config, self.model_config)
        kernel = self._options().kernel
        super()._build_tf_config()
        provider = getattr(self, "provider", None)
        if provider is not None:
            hook_provider(provider, kernel=kernel)
        else:  # megatron.vanilla_mbridge=True: the bridge builds the layer spec itself
            hook_mbridge(self.bridge, kernel=kernel)

    # ------------------------------------------------------------------ micro-batches
    def forward_backward_batch(self, data: TensorDict, loss_function, forward_only=False):
        check_config(self.engine_config, self.model_config)
        self._options()
        metrics = {}
        if self._verify() is not None and not forward_only and self.verify.due():
            metrics["branch/max_logprob_diff"] = self._run_check(data)
        use_dynamic = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True)
        patch = (_micro_batches_by_group() if use_dynamic else contextlib.nullcontext())
        self._sharing = SharingStats()
        try:
            with patch:
                output = super().forward_backward_batch(data, loss_function, forward_only)
        finally:
            sharing, self._sharing = self._sharing, None
        metrics.update(sharing.metrics(group=self._dp_group_or_none()))
        if sharing.split_groups and not self.split_warned:
            # once per engine (every step would flood verl's log); branch/split_groups counts every step
            self.split_warned = True
            logger.warning("megatron_branch: %d rollout group(s) (same uid) arrived split across micro-batches or "
                           "data-parallel ranks: exact, but each part computes its shared prefix again (verl's "
                           "trainer.balance_batch and actor.shuffle move rollouts of a group apart; a group larger "
                           "than max_token_len_per_gpu is cut to fit); the metric branch/split_groups counts them "
                           "at every step", sharing.split_groups)
        if isinstance(output, dict):
            output.setdefault("metrics", {}).update({k: [v] for k, v in metrics.items()})
        return output

    def _dp_group_or_none(self):
        if not torch.distributed.is_initialized():
            return None
        try:
            return self.get_data_parallel_group()
        except (AssertionError, AttributeError, RuntimeError):  # Megatron's parallel state not built
            return None

    # ------------------------------------------------------------------ the forward
    def forward_step(self, batch_iter: Iterator[TensorDict], model, logits_processor_func,
                     postprocess_micro_batch_func):
        batch: TensorDict = next(batch_iter)
        batch = batch.to(get_device_id())
        check_micro_batch(batch)
        input_ids = batch["input_ids"]
        offsets = input_ids.offsets()
        if getattr(self, "_sharing", None) is not None:
            self._sharing.add(input_ids.values(), offsets, batch_uids(batch))
        entropy = bool(tu.get_non_tensor_data(batch, key="calculate_entropy", default=False))
        temps = _temperatures(batch, int(offsets.numel() - 1))
        routing = None  # R3: verl sets enable_routing_replay for old log-probs and the update, not the reference
        if self._replays_routes() and tu.get_non_tensor_data(batch, key="enable_routing_replay", default=False):
            routers = moe_routers(model)
            routing = rollout_routing(batch, routers, int(routers[0].config.num_layers) if routers else 0)
        budget = self._options().max_chunk_tokens
        if budget is not None and not torch.is_grad_enabled() and not entropy:
            # verl's infer_batch (old/ref log-probs) runs under no_grad: stream the tree
            lp, ent = _streamed_logprobs(model, input_ids.values(), offsets, temps, budget, routing), None
        else:
            if budget is not None and not torch.is_grad_enabled():
                log_once("megatron_branch verl engine: a forward-only pass asks for entropy; it runs one forward "
                         "per micro-batch (max_chunk_tokens streams log-probs only)", logging.WARNING)
            out = packed_logprobs(model, input_ids.values(), offsets.to("cpu"), temperature=temps, entropy=entropy,
                                  routing=None if routing is None else torch.cat(routing))
            lp, ent = out if entropy else (out, None)
        output = {"log_probs": torch.nested.nested_tensor_from_jagged(lp, offsets)}
        if ent is not None:
            output["entropy"] = torch.nested.nested_tensor_from_jagged(ent, offsets)
        return output, partial(postprocess_micro_batch_func, data=batch, local_cp_size=None)

    # ------------------------------------------------------------------ run-time check
    def _verify(self) -> Optional[ExactnessCheck]:
        if self.verify is None and os.environ.get(VERIFY_EVERY_ENV):
            tol = os.environ.get(VERIFY_TOLERANCE_ENV)
            self.verify = ExactnessCheck(every=int(os.environ[VERIFY_EVERY_ENV]),
                                         tolerance=float(tol) if tol else 1e-3)
        return self.verify

    def _run_check(self, data: TensorDict) -> float:
        sequences = list(data["input_ids"].unbind())
        tree = BranchTree.from_sequences([s.cpu() for s in sequences])
        picked = sample_rollouts(tree, self.verify.rollouts)
        temps = _temperatures(data, len(sequences))[torch.tensor(picked)]
        model = self.module[0]
        return self.verify.run(model, [sequences[i] for i in picked], temps)


@contextlib.contextmanager
def _micro_batches_by_group():
    """Scoped: verl's Megatron engine takes its micro-batches from :func:`group_micro_batches`
    (same contract as its ``prepare_micro_batches``) for one ``forward_backward_batch`` call.
    A runtime patch of one module attribute, undone on exit; verl 0.9.1."""
    saved = transformer_impl.prepare_micro_batches
    transformer_impl.prepare_micro_batches = group_micro_batches
    try:
        yield
    finally:
        transformer_impl.prepare_micro_batches = saved


def layout_is_supported() -> bool:
    """This process's Megatron layout is one the adapter runs (PP = CP = 1)."""
    layout = ParallelLayout.current()
    return layout.pp == 1 and layout.cp == 1
