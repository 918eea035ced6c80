"""``megatron-branch demo`` runs end to end (short setting) and is exact."""

import json
import subprocess
import sys

from megatron_branch.commands.demo import DemoConfig, run_demo


def test_demo_quick_is_exact():
    lines = []
    result = run_demo(DemoConfig.quick(), echo=lines.append)
    assert result["unique_positions"] < result["naive_positions"]
    assert result["max_abs_logprob_diff"] < 1e-5
    assert result["max_rel_grad_diff"] < 1e-5
    assert result["loss_rel_diff"] < 1e-5
    assert result["speedup"] > 0
    assert any("speed-up" in line for line in lines)


def test_cli_demo_writes_json(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_branch.cli", "demo", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["max_rel_grad_diff"] < 1e-5
    assert "exactness vs stock spec" in proc.stdout


def test_cli_help():
    proc = subprocess.run([sys.executable, "-m", "megatron_branch.cli", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "demo" in proc.stdout


def test_cli_help_of_a_command_is_quiet():
    # megatron-core's import-time warnings about the Apex/TE fallbacks (expected on CPU)
    # must not reach the user: the CLI silences them before it imports megatron-core
    proc = subprocess.run([sys.executable, "-m", "megatron_branch.cli", "plan", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--prompt-len" in proc.stdout
    assert proc.stderr == "", proc.stderr[-2000:]
