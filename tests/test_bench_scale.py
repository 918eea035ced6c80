"""``megatron-branch bench-scale``: measured per-rank peaks vs the planner's memory model,
on a context-parallel run the model's constants were not fitted on."""

import json
import subprocess
import sys

import pytest

from megatron_branch import cli
from megatron_branch.commands.bench import scale


def test_bench_scale_cp2_prediction_within_20_percent(tmp_path):
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, "-m", "megatron_branch.cli", "bench-scale", "--prompt-len", "2048",
                           "--rollouts", "8", "--response-len", "128", "--cp", "2", "--chunk-tokens", "512",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["measured_peak_bytes"]) == len(report["predicted_peak_bytes"]) == 2
    assert report["layout"]["cp"] == 2 and report["stems"] >= 3
    for m, p in zip(report["measured_peak_bytes"], report["predicted_peak_bytes"]):
        assert abs(p / m - 1) <= 0.2, (m, p)
    assert "within the 20% goal" in proc.stdout


@pytest.mark.parametrize("argv, expect", [
    (["--cp", "0"], "--cp: must be >= 1, got 0"),
    (["--tp", "3"], "--tp 3 does not divide the model's 4 attention heads; use --tp 1 or 2"),
    (["--tp", "4", "--cp", "1"], "--tp 4 does not divide the model's 2 query (key/value) groups"),
    (["--tp", "2", "--cp", "4", "--chunk-tokens", "4"], "--chunk-tokens 4 is below --tp 2 x --cp 4 = 8"),
])
def test_bench_scale_refuses_a_bad_layout_before_spawning(argv, expect, monkeypatch, capsys):
    def spawn(*args, **kwargs):
        raise AssertionError("bench-scale spawned processes for a layout it should have refused")

    monkeypatch.setattr(scale.mp, "spawn", spawn)
    assert cli.main(["bench-scale", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("megatron-branch bench-scale: error: ") and expect in err, err
