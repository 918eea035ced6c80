"""``tools/gpu_check.py`` tells the truth on a machine without a GPU: it refuses to run,
and its report cannot pass by skipping (the section logic runs here on plain functions)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TOOLS, load_tool

TOOL = os.path.join(TOOLS, "gpu_check.py")


def _tool():
    return load_tool("gpu_check")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check itself runs there")
def test_without_cuda_it_exits_non_zero_and_says_so():
    proc = subprocess.run([sys.executable, TOOL, "--quick", "--out", os.devnull], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and proc.stderr.count("\n") == 1


def test_a_skipped_section_fails_the_run():
    tool = _tool()

    def te():
        raise tool.Skip("Transformer Engine is not importable")

    lines = []
    report = tool.run_sections([("ok", lambda: {"passed": True}), ("te", te)], echo=lines.append)
    assert report["sections"]["ok"]["status"] == "passed"
    assert report["sections"]["te"] == {"status": "skipped", "reason": "Transformer Engine is not importable",
                                        "seconds": report["sections"]["te"]["seconds"]}
    assert report["status"] == "failed" and report["not_passed"] == ["te"]
    assert lines == ["ok: passed", "te: skipped (Transformer Engine is not importable)"]


def test_errors_and_failures_are_recorded_and_every_section_runs():
    tool = _tool()

    def broken():
        raise RuntimeError("kernel launch failed")

    report = tool.run_sections([("a", broken), ("b", lambda: {"passed": False, "x": 1}),
                                ("c", lambda: {"passed": True})], echo=lambda line: None)
    assert report["sections"]["a"]["status"] == "failed" and "kernel launch failed" in report["sections"]["a"]["error"]
    assert report["sections"]["b"]["status"] == "failed" and report["sections"]["b"]["x"] == 1
    assert report["sections"]["c"]["status"] == "passed"
    assert report["status"] == "failed" and report["not_passed"] == ["a", "b"]
    assert tool.run_sections([], echo=lambda line: None)["status"] == "failed"  # nothing ran: not a pass


def test_a_section_past_its_time_fails_and_the_next_runs():
    tool = _tool()

    def slow():
        import time

        time.sleep(5)
        return {"passed": True}

    report = tool.run_sections([("slow", slow, 0.2), ("next", lambda: {"passed": True}, 5)], echo=lambda line: None)
    assert report["sections"]["slow"]["status"] == "failed" and "0 s limit" in report["sections"]["slow"]["reason"]
    assert report["sections"]["slow"]["seconds"] < 2 and report["sections"]["next"]["status"] == "passed"


def test_the_quick_run_fits_eight_minutes():
    tool = _tool()
    assert sum(tool.TIMEOUTS.values()) <= 8 * 60 - 20  # 20 s for start-up, imports and the report


def test_dry_run_exercises_every_section_on_the_cpu(tmp_path):
    """Every section's code runs on the CPU at toy sizes (what needs CUDA or TE skips with
    its reason), so the one GPU run is not spent on a typo."""
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, TOOL, "--dry-run", "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert list(sections) == ["contract", "parity_bf16", "exactness_local", "exactness_te", "fp8", "long_tree",
                              "streaming", "host_syncs"]
    for name, result in sections.items():  # every section ran to its verdict (CPU numbers are no GPU's)
        needs = "Transformer Engine" if name in ("exactness_te", "fp8") else "CUDA"
        if result["status"] == "skipped":
            assert needs in result["reason"], (name, result)
        else:  # no exception, no timeout: a verdict from numbers
            assert "error" not in result and "reason" not in result, (name, result)
    assert report["dry_run"] and proc.returncode == 1  # a dry run never passes: skipped sections fail it
    assert sections["long_tree"]["unique_tokens"] < sections["long_tree"]["naive_tokens"]
