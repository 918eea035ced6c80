"""``megatron-branch bench-scale``: measured per-rank peaks vs the planner's memory model,
on a context-parallel run the model's constants were not fitted on."""

import json
import subprocess
import sys


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


def test_bench_scale_rejects_bad_sizes():
    proc = subprocess.run([sys.executable, "-m", "megatron_branch.cli", "bench-scale", "--cp", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--cp must be >= 1" in proc.stdout
