"""``megatron-branch verl-check``: which engine verl 0.9.1 would build, and why not branch.

The command composes verl's own trainer configs (hydra, from verl's installed config folder)
and asks verl's ``EngineRegistry``; runs in the ``[verl]`` venv of ``.ci/run``.
"""

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]': its own venv in .ci/run)")

from megatron_branch.cli import main  # noqa: E402

GOOD = ["actor_rollout_ref.actor.use_dynamic_bsz=True", "trainer.balance_batch=False"]


def check(capsys, *argv):
    code = main(["verl-check", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "branch")
    for name in ("VERL_USE_EXTERNAL_PLUGINS", "VERL_ENGINE_DEVICE", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_documented_launch_builds_the_branch_engine(env, capsys):
    code, out, _ = check(capsys, "ppo_megatron_trainer", *GOOD)
    assert code == 0, out
    assert "actor engine: BranchMegatronEngine (megatron_branch: branch replay)" in out
    code, out, _ = check(capsys, "ppo_trainer", "model_engine=megatron", *GOOD)
    assert code == 0 and "BranchMegatronEngine" in out


def test_why_not_branch_is_named(env, capsys):
    env.setenv("VERL_ENGINE_VENDOR", "brnach")
    code, out, _ = check(capsys, "ppo_megatron_trainer", *GOOD)
    assert code == 1 and "MegatronEngineWithLMHead" in out and "did you mean branch?" in out
    env.setenv("VERL_ENGINE_VENDOR", "branch")
    env.setenv("VERL_USE_EXTERNAL_PLUGINS", "none")
    code, out, _ = check(capsys, "ppo_megatron_trainer", *GOOD)
    assert code == 1 and "VERL_USE_EXTERNAL_PLUGINS=none" in out and "MegatronEngineWithLMHead" in out
    env.delenv("VERL_USE_EXTERNAL_PLUGINS")
    code, out, _ = check(capsys, "ppo_trainer", "actor_rollout_ref.actor.strategy=megatron")
    assert code == 1 and "actor_rollout_ref.actor.megatron: missing" in out
    code, out, _ = check(capsys, "ppo_trainer")
    assert code == 1 and "actor_rollout_ref.actor.strategy=fsdp" in out


def test_what_the_branch_engine_refuses_is_named(env, capsys):
    for override, option in (("actor_rollout_ref.actor.megatron.context_parallel_size=2", "context_parallel_size > 1"),
                             ("actor_rollout_ref.model.use_fused_kernels=True", "use_fused_kernels=True"),
                             ("actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend=local",
                              "attention_backend=local"),
                             ("+actor_rollout_ref.actor.megatron.override_mcore_model_config.branch.kernel=nope",
                              "override_mcore_model_config.branch.kernel"),
                             ("actor_rollout_ref.actor.megatron.router_replay.mode=R2",
                              "megatron.router_replay.mode=R2")):
        code, out, _ = check(capsys, "ppo_megatron_trainer", override, *GOOD)
        assert code == 1 and "refuses this configuration at initialize()" in out and option in out, out


def test_notes_name_the_settings_that_split_groups(env, capsys):
    env.setenv("RAY_ADDRESS", "auto")
    code, out, _ = check(capsys, "ppo_megatron_trainer", "actor_rollout_ref.actor.shuffle=True")
    assert code == 0
    for text in ("trainer.balance_batch=True", "use_prefix_grouper=True", "actor.shuffle=True",
                 "use_dynamic_bsz=False", "RAY_ADDRESS",
                 "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR=branch"):
        assert text in out, text


def test_a_yaml_file_and_bad_input(env, capsys, tmp_path):
    from omegaconf import OmegaConf

    composed = tmp_path / "config.yaml"  # as hydra saves it in .hydra/config.yaml: no defaults list
    OmegaConf.save({"actor_rollout_ref": {"actor": {"strategy": "megatron", "use_dynamic_bsz": True,
                                                    "megatron": {"context_parallel_size": 1}},
                                          "model": {"use_remove_padding": True}}, "trainer": {}}, composed)
    code, out, _ = check(capsys, str(composed))
    assert code == 0 and "BranchMegatronEngine" in out
    user = tmp_path / "my_trainer.yaml"  # a user's config on top of verl's
    user.write_text("defaults:\n  - ppo_megatron_trainer\n  - _self_\ntrainer:\n  balance_batch: false\n")
    code, out, _ = check(capsys, str(user), "actor_rollout_ref.actor.use_dynamic_bsz=True")
    assert code == 0 and "balance_batch" not in out  # the user's file turned it off
    for argv, text in (([str(tmp_path / "missing.yaml")], "CONFIG: "), (["ppo_nope"], "neither a file nor"),
                       (["ppo_megatron_trainer", "no_such_key=1"], "CONFIG ppo_megatron_trainer:")):
        code, out, err = check(capsys, *argv)
        assert code == 2 and text in err and len(err.strip().splitlines()) == 1, err


def test_verls_group_balance_counts_as_keeping_groups(env, capsys):
    code, out, _ = check(capsys, "ppo_megatron_trainer", "actor_rollout_ref.actor.use_dynamic_bsz=True",
                         "trainer.use_v1=False", "actor_rollout_ref.actor.use_prefix_grouper=True")
    assert code == 0 and "balance_batch" not in out and "notes" not in out, out


def test_the_reference_engine_is_checked_with_its_own_keys(env, capsys):
    code, out, _ = check(capsys, "--role", "ref", "ppo_megatron_trainer", *GOOD,
                         "+actor_rollout_ref.ref.megatron.override_mcore_model_config.branch.max_chunk_tokens=0")
    assert code == 1 and out.count("ref engine: BranchMegatronEngine, which refuses") == 1
    assert "branch.max_chunk_tokens" in out
    code, out, _ = check(capsys, "--role", "ref", "ppo_megatron_trainer", *GOOD)
    assert code == 0 and "ref engine: BranchMegatronEngine (megatron_branch: branch replay)" in out


def test_rollout_routing_replay_builds_the_branch_engine(env, capsys):
    """R3 runs under branch replay; the note names the rollout option that records the routes."""
    r3 = "actor_rollout_ref.actor.megatron.router_replay.mode=R3"
    code, out, _ = check(capsys, "ppo_megatron_trainer", *GOOD, r3)
    assert code == 0 and "actor engine: BranchMegatronEngine (megatron_branch: branch replay)" in out
    assert "enable_rollout_routing_replay=True" in out
    code, out, _ = check(capsys, "ppo_megatron_trainer", *GOOD, r3,
                         "actor_rollout_ref.rollout.enable_rollout_routing_replay=True")
    assert code == 0 and "enable_rollout_routing_replay" not in out
