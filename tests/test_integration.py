"""Integration points: Megatron-LM spec module, the patch checker."""

import os
import subprocess
import sys

from megatron_branch.spec.core_attention import BranchCoreAttention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "apply_patches.py")


def test_megatron_lm_spec_attribute():
    import importlib.util

    import pytest

    from megatron_branch.integrations import megatron_lm

    spec = megatron_lm.branch_layer_spec
    if importlib.util.find_spec("megatron.training") is None:
        with pytest.raises(ImportError, match="built from Megatron-LM's parsed arguments"):
            spec.submodules
    explicit = megatron_lm.get_branch_spec(qk_layernorm=True)
    assert explicit.submodules.self_attention.submodules.core_attention.module is BranchCoreAttention


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env=dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                            GIT_COMMITTER_EMAIL="t@t"))


def test_apply_patches_checks_cleanly_and_reports_failures(tmp_path):
    repo = tmp_path / "up"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "commit", "-qm", "init")
    patches = tmp_path / "patches" / "up-1.0"
    patches.mkdir(parents=True)
    (patches / "0001-good.patch").write_text(
        "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n")
    run = lambda *a: subprocess.run([sys.executable, TOOL, "--checkout", str(repo), "--patches",  # noqa: E731
                                     str(tmp_path / "patches"), *a], capture_output=True, text=True)
    ok = run()
    assert ok.returncode == 0 and "ok   up-1.0/0001-good.patch" in ok.stdout
    (patches / "0002-bad.patch").write_text("--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-y = 1\n+y = 2\n")
    bad = run("--apply")
    assert bad.returncode == 1 and "FAIL up-1.0/0002-bad.patch" in bad.stdout
    assert (repo / "a.py").read_text() == "x = 1\n"  # nothing applied when one fails
    none = subprocess.run([sys.executable, TOOL, "--checkout", str(repo)], capture_output=True, text=True)
    assert none.returncode == 0 and "no patches" in none.stdout
    not_git = subprocess.run([sys.executable, TOOL, "--checkout", str(tmp_path)], capture_output=True, text=True)
    assert not_git.returncode == 2 and "is not a git checkout" in not_git.stderr
