"""``megatron-branch verl-check``: which engine verl 0.9.1 would build, and why not branch.

Reads the trainer configuration the way ``python -m verl.trainer.main_ppo`` composes it — a
verl config name (``ppo_megatron_trainer``, ``ppo_trainer``) or a YAML file, plus the same
``key=value`` overrides as the launch command — and the environment of this shell, then
prints the engine class verl's ``EngineRegistry`` would return for the actor (``--role ref``:
the reference policy) and, when it is not megatron_branch's ``BranchMegatronEngine``, every
reason:

* the plugin does not load (``VERL_USE_EXTERNAL_PLUGINS=none`` or a list without
  ``megatron_branch``, no ``verl.plugins`` entry point, an import error that verl itself logs
  only at debug level);
* ``VERL_ENGINE_VENDOR`` unset or misspelt, ``VERL_ENGINE_DEVICE`` set to another device;
* the role's strategy is not ``megatron``, or the Megatron engine keys are missing (the
  default config with ``strategy=megatron`` builds an FSDP engine config);
* a setting the branch engine refuses (it raises ``ValueError`` at ``initialize()``; router
  replay R3 runs, R2 is refused).

Notes follow on what keeps groups of rollouts together (``trainer.balance_batch`` unless
verl's group balance is on, ``actor.shuffle``, ``use_dynamic_bsz``), on Ray workers (a
cluster started outside the launch does not inherit this shell's environment) and on verl's
v1 trainer (it needs TransferQueue).
Exit code 0 when the branch engine would run, 1 when not.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import types
from typing import List, Optional, Tuple

PLUGIN = "megatron_branch"
ROLES = ("actor", "ref")


def add_arguments(parser) -> None:
    parser.add_argument("config", metavar="CONFIG",
                        help="a verl config name (ppo_megatron_trainer, ppo_trainer) or a YAML file of the trainer "
                             "configuration")
    parser.add_argument("overrides", metavar="KEY=VALUE", nargs="*", default=None,
                        help="overrides as given to verl.trainer.main_ppo (e.g. model_engine=megatron "
                             "actor_rollout_ref.actor.use_dynamic_bsz=True)")
    parser.add_argument("--role", choices=ROLES, default="actor",
                        help="the engine to check: the actor's or the reference policy's (each has its own "
                             "megatron engine keys)")


def _verl_config_dir() -> str:
    import verl

    return os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def load_config(config: str, overrides: List[str]):
    """The composed trainer config (an OmegaConf ``DictConfig``).

    Raises:
        ValueError: a file that does not exist or does not parse, a config name verl does not
            ship, overrides hydra rejects.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    path = os.path.abspath(config)
    looks_like_file = config.endswith((".yaml", ".yml")) or os.sep in config
    if looks_like_file and not os.path.isfile(path):
        raise ValueError(f"CONFIG: {config} does not exist")
    if os.path.isfile(path):
        try:
            raw = OmegaConf.load(path)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the file's
            raise ValueError(f"CONFIG: {config} is not a YAML mapping ({str(exc).splitlines()[0]})") from exc
        if "defaults" not in raw:  # a composed config (e.g. hydra's .hydra/config.yaml): overrides as a dot list
            try:
                return OmegaConf.merge(raw, OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))
            except Exception as exc:  # noqa: BLE001
                raise ValueError(f"KEY=VALUE: {str(exc).splitlines()[0]}") from exc
        config_dir, name = os.path.dirname(path), os.path.splitext(os.path.basename(path))[0]
        # the user's file names verl's configs in its defaults: verl's folder is on the search path
        overrides = [f"hydra.searchpath=[file://{_verl_config_dir()}]"] + list(overrides)
    else:
        config_dir, name = _verl_config_dir(), config
        if not os.path.isfile(os.path.join(config_dir, f"{name}.yaml")):
            shipped = sorted(f[:-5] for f in os.listdir(config_dir) if f.endswith(".yaml") and not f.startswith("_"))
            raise ValueError(f"CONFIG: {config} is neither a file nor a verl config name ({', '.join(shipped)})")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return compose(config_name=name, overrides=list(overrides))
    except Exception as exc:  # noqa: BLE001 - hydra's errors: bad override, missing group
        raise ValueError(f"CONFIG {config}: {str(exc).splitlines()[0]}") from exc


def plugin_problems() -> List[str]:
    """Why verl would not import megatron_branch's plugin in this environment (empty: it would)."""
    from importlib.metadata import entry_points

    problems = []
    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    if policy == "none":
        problems.append("VERL_USE_EXTERNAL_PLUGINS=none: verl loads no plugins (unset it, or list megatron_branch)")
    elif policy != "auto" and PLUGIN not in {p.strip() for p in policy.split(",")}:
        problems.append(f"VERL_USE_EXTERNAL_PLUGINS={policy}: the list does not name {PLUGIN} (add it)")
    found = [ep for ep in entry_points(group="verl.plugins") if ep.name == PLUGIN]
    if not found:
        problems.append(f"no 'verl.plugins' entry point named {PLUGIN}: install the package into verl's environment "
                        "(pip install -e '.[verl]')")
    else:
        try:
            found[0].load()
        except Exception as exc:  # noqa: BLE001 - verl swallows this one at debug level
            problems.append(f"the plugin does not import: {type(exc).__name__}: {str(exc).splitlines()[0]} "
                            "(verl logs this only at debug level and builds its stock engine)")
    return problems


def vendor_problems(config) -> List[str]:
    """Why ``VERL_ENGINE_VENDOR`` / ``VERL_ENGINE_DEVICE`` would not select the branch engine."""
    from omegaconf import OmegaConf

    # the adapter imports verl, which only this command's environment has
    from megatron_branch.integrations.verl import VENDOR

    problems = []
    vendor = os.environ.get("VERL_ENGINE_VENDOR")
    ray_vendor = OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR", default=None)
    if ray_vendor is not None and str(ray_vendor) != (vendor or ""):
        problems.append(f"ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR={ray_vendor} differs from this "
                        f"shell's ({vendor!r}): the workers use the config's; set both to {VENDOR}")
    if not vendor:
        problems.append(f"VERL_ENGINE_VENDOR is not set: export VERL_ENGINE_VENDOR={VENDOR}")
    elif vendor != VENDOR:
        close = difflib.get_close_matches(vendor.lower(), [VENDOR], n=1, cutoff=0.5)
        hint = f" (did you mean {VENDOR}?)" if close else ""
        problems.append(f"VERL_ENGINE_VENDOR={vendor}: not {VENDOR}{hint}; verl falls back to its stock engine")
    device = os.environ.get("VERL_ENGINE_DEVICE")
    if device and device != "cuda":
        problems.append(f"VERL_ENGINE_DEVICE={device}: the branch engine is registered for cuda")
    return problems


def config_problems(config, role: str = "actor") -> List[str]:
    """Why the configuration of ``role`` (actor, ref) would not run on the branch engine (empty: it would)."""
    from omegaconf import OmegaConf

    problems = []
    key = f"actor_rollout_ref.{role}"
    section = OmegaConf.select(config, key)
    if section is None:
        return [f"{key}: missing; not a verl PPO trainer configuration"]
    strategy = OmegaConf.select(section, "strategy", default=None)
    if strategy != "megatron":
        problems.append(f"{key}.strategy={strategy}: verl builds its {strategy} engine; use "
                        "--config-name ppo_megatron_trainer (or model_engine=megatron)")
        return problems
    megatron = OmegaConf.select(section, "megatron", default=None)
    if megatron is None:
        problems.append(f"{key}.megatron: missing; strategy=megatron on the default config keeps the "
                        "FSDP engine keys, which verl's Megatron engine cannot take: use --config-name "
                        "ppo_megatron_trainer (or model_engine=megatron)")
        return problems
    # the adapter imports verl, which only this command's environment has
    from megatron_branch.integrations.options import verl_branch_options
    from megatron_branch.integrations.verl import check_config

    try:  # the reference's keys interpolate the actor's (${oc.select:...})
        values = OmegaConf.to_container(megatron, resolve=True)
    except Exception as exc:  # noqa: BLE001 - omegaconf's interpolation errors
        raise ValueError(f"{key}.megatron: {str(exc).splitlines()[0]}") from exc
    engine = types.SimpleNamespace(**values)
    engine.router_replay = types.SimpleNamespace(**(engine.router_replay or {})) \
        if isinstance(getattr(engine, "router_replay", None), dict) else getattr(engine, "router_replay", None)
    model = OmegaConf.select(config, "actor_rollout_ref.model", default={})
    engine.use_fused_kernels = bool(OmegaConf.select(model, "use_fused_kernels", default=False))
    engine.use_remove_padding = bool(OmegaConf.select(model, "use_remove_padding", default=True))
    model_ns = types.SimpleNamespace(mtp=types.SimpleNamespace(
        enable=bool(OmegaConf.select(model, "mtp.enable", default=False))), model_type="language_model")
    for check in (lambda: check_config(engine, model_ns), lambda: verl_branch_options(engine)):
        try:
            check()
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def notes(config) -> List[str]:
    """Settings that run but lose sharing or stop the launch (not reasons against the engine)."""
    from omegaconf import OmegaConf

    out = []
    group_balance = (OmegaConf.select(config, "actor_rollout_ref.actor.use_prefix_grouper", default=False)
                     and not OmegaConf.select(config, "trainer.use_v1", default=False))
    if OmegaConf.select(config, "trainer.balance_batch", default=False) and not group_balance:
        out.append("trainer.balance_batch=True reorders rollouts by length across data-parallel ranks, which splits "
                   "groups (exact, less shared; branch/split_groups counts them): set trainer.balance_batch=False, "
                   "or balance whole groups with actor_rollout_ref.actor.use_prefix_grouper=True and "
                   "trainer.use_v1=False")
    if OmegaConf.select(config, "actor_rollout_ref.actor.shuffle", default=False):
        out.append("actor_rollout_ref.actor.shuffle=True spreads a group over mini-batches: set it to False")
    if not OmegaConf.select(config, "actor_rollout_ref.actor.use_dynamic_bsz", default=False):
        out.append("actor_rollout_ref.actor.use_dynamic_bsz=False: verl's fixed-size micro-batches cut groups; "
                   "set it to True (the budget is ppo_max_token_len_per_gpu unique tokens)")
    if OmegaConf.select(config, "actor_rollout_ref.actor.megatron.router_replay.mode", default=None) == "R3" and \
            not OmegaConf.select(config, "actor_rollout_ref.rollout.enable_rollout_routing_replay", default=False):
        out.append("actor_rollout_ref.actor.megatron.router_replay.mode=R3 replays the rollout's routes: set "
                   "actor_rollout_ref.rollout.enable_rollout_routing_replay=True so that the rollout records them "
                   "(without them the first replayed pass raises, naming routed_experts)")
    if os.environ.get("RAY_ADDRESS") and not OmegaConf.select(
            config, "ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR", default=None):
        out.append("RAY_ADDRESS is set: a Ray cluster started outside this shell does not see its environment; add "
                   "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR=branch")
    if OmegaConf.select(config, "trainer.use_v1", default=False) and importlib.util.find_spec("transfer_queue") is None:
        out.append("trainer.use_v1=True needs TransferQueue, which is not installed: pip install TransferQueue, or "
                   "trainer.use_v1=False (verl's v0 trainer: the same engine workers)")
    return out


def resolve(config, role: str = "actor") -> Tuple[Optional[str], List[str], List[str]]:
    """(engine class name verl would build for ``role``, reasons it is not the branch engine, notes)."""
    from omegaconf import OmegaConf

    reasons = plugin_problems()
    loaded = not reasons
    reasons += vendor_problems(config)
    reasons += config_problems(config, role)
    name = None
    if OmegaConf.select(config, f"actor_rollout_ref.{role}.strategy", default=None) == "megatron":
        from verl.workers.engine.base import EngineRegistry

        saved = os.environ.get("VERL_ENGINE_VENDOR")
        ray_vendor = OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR",
                                      default=None)
        if ray_vendor is not None:  # what the workers will see
            os.environ["VERL_ENGINE_VENDOR"] = str(ray_vendor)
        try:
            cls = EngineRegistry.get_engine_cls("language_model", "megatron")
        finally:
            if saved is None:
                os.environ.pop("VERL_ENGINE_VENDOR", None)
            else:
                os.environ["VERL_ENGINE_VENDOR"] = saved
        name = cls.__name__
        if name == "BranchMegatronEngine" and not loaded:
            name = "MegatronEngineWithLMHead"  # in verl's processes the plugin would not have registered it
    return name, reasons, notes(config)


def main(args) -> int:
    if importlib.util.find_spec("verl") is None:
        raise ValueError("verl is not installed in this environment (pip install -e '.[verl]')")
    from importlib.metadata import version

    args.overrides = list(args.overrides or [])
    config = load_config(args.config, args.overrides)
    name, reasons, extra = resolve(config, args.role)
    print(f"verl {version('verl')}; config {args.config}" + (f" with {len(args.overrides)} override(s)"
                                                             if args.overrides else ""))
    branch = name == "BranchMegatronEngine" and not reasons
    if branch:
        print(f"{args.role} engine: BranchMegatronEngine (megatron_branch: branch replay)")
    elif name == "BranchMegatronEngine":
        print(f"{args.role} engine: BranchMegatronEngine, which refuses this configuration at initialize() "
              "(ValueError):")
    else:
        print(f"{args.role} engine: {name or 'not a Megatron engine'} (verl's stock engine: no branch replay), "
              "because:")
    for reason in reasons:
        print(f"  - {reason}")
    if extra:
        print("notes:")
        for note in extra:
            print(f"  - {note}")
    return 0 if branch else 1
