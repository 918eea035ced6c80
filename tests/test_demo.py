"""``megatron-branch demo`` runs end to end (short setting) and is exact."""

import json
import subprocess
import sys

import pytest

from megatron_branch import cli
from megatron_branch.commands import demo
from megatron_branch.commands.bench.methods import naive_micro_batches
from megatron_branch.commands.demo import DemoConfig, load_warning, run_demo


def test_demo_quick_is_exact(monkeypatch):
    monkeypatch.setattr(demo, "machine_load", lambda: 1e3)  # a loaded machine: the demo must say so
    lines = []
    result = run_demo(DemoConfig.quick(), echo=lines.append)
    assert result["unique_positions"] < result["naive_positions"]
    assert result["max_abs_logprob_diff"] < 1e-5
    assert result["max_rel_grad_diff"] < 1e-5
    assert result["loss_rel_diff"] < 1e-5
    assert result["speedup"] > 0
    assert any("speed-up" in line for line in lines)
    sweep = ", ".join(map(str, naive_micro_batches(result["rollouts"])))
    assert f"naive: micro-batches of {sweep} rollouts (gradient accumulation); the fastest is the reference" in lines
    assert result["load_average"] == 1e3
    assert sum("timings below are unreliable" in line for line in lines) == 1


def test_load_warning_only_when_the_load_exceeds_the_cores():
    line = load_warning(5.3, 2)
    assert "load average 5.3" in line and "2 cores" in line and "megatron-branch demo --quick" in line
    assert "\n" not in line
    assert load_warning(2.0, 2) is None  # at the core count: not loaded
    assert load_warning(None, 2) is None and load_warning(3.0, None) is None  # unknown (no getloadavg)


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


def _help(command):
    """``megatron-branch [command] --help`` as printed (in-process: the CLI's own parser)."""
    parser = cli.build_parser(command)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([command, "--help"] if command else ["--help"])
    assert exit_.value.code == 0
    return parser


@pytest.mark.parametrize("command", [None] + [name for name, _, _ in cli.COMMANDS])
def test_help_is_plain_text_with_defaults(command, capsys):
    _help(command)
    text = capsys.readouterr().out
    for markup in (":func:", ":mod:", ":class:", ":meth:", ":data:", "``", "**"):
        assert markup not in text, (command, markup)
    assert "default: None" not in text and "default: False" not in text
    if command:
        assert "(default: " in text


def test_help_states_the_presets_defaults_and_the_naive_sweep(capsys):
    from megatron_branch.commands.bench.run import BenchConfig

    _help("demo")
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert f"(default: {DemoConfig().repeats}; --quick: {DemoConfig.quick().repeats})" in text
    assert "(default: cascade)" in text
    assert naive_micro_batches(16) == [1, 2, 4, 8, 16] and "1, 2, 4, 8, 16 for 16 rollouts" in text
    _help("bench")
    text = " ".join(capsys.readouterr().out.split())
    full, quick = BenchConfig.full(), BenchConfig.quick()
    assert f"timed repeats per method (median) (default: {full.repeats}; --quick: {quick.repeats})" in text
    assert f"model width (default: {full.hidden_size})" in text and "--verbose" in text
