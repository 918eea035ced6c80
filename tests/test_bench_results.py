"""The results folder: one file per configuration, merged by ``bench --publish``, listed in a
manifest that ``bench --table`` reads (``megatron_branch/commands/bench/results.py``)."""

import json
import os
import subprocess
import sys

import pytest

from megatron_branch.commands.bench import results
from megatron_branch.commands.bench.table import config_line, markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _report(shapes, speedup=2.0, hidden=64, threads=1, commit="abc1234"):
    def shape(name):
        return {"shape": name, "rollouts": 4, "segments": 2, "ideal_flop_ratio": 3.0, "naive_reference": "naive_mb1",
                "methods": [{"method": "naive_mb1", "seconds": {"median": 1.0, "min": 1.0, "max": 1.0}},
                            {"method": "ours", "speedup": {"median": speedup, "min": speedup, "max": speedup},
                             "fraction_of_ideal": {"median": speedup / 3, "min": speedup / 3, "max": speedup / 3}}]}
    config = {"hidden_size": hidden, "num_attention_heads": 4, "num_query_groups": 2, "num_layers": 2,
              "repeats": 3, "chunk_tokens": 48, "shapes": [{"name": n} for n in shapes]}
    return {"config": config, "torch_threads": threads, "device": "cpu", "torch_version": "2.13.0",
            "machine": {"cpus": 2, "load_average": [0.5, 0.5, 0.5]}, "commit": commit, "date": "2026-12-07",
            "shapes": [shape(n) for n in shapes]}


def test_a_run_of_a_few_shapes_replaces_only_those(tmp_path):
    out = str(tmp_path / "results")
    order = ["A", "B", "C"]
    path, first = results.publish(_report(order), out, "hidden 64, 1 thread", order)
    assert os.path.basename(path) == "bench_cpu_h64_heads4_kv2_t1.json"
    assert [s["run"] for s in first["shapes"]] == [0, 0, 0] and first["runs"][0]["commit"] == "abc1234"
    _, merged = results.publish(_report(["B"], speedup=2.5, commit="def5678"), out, "hidden 64, 1 thread", order)
    assert [s["shape"] for s in merged["shapes"]] == order  # the bench's order, whichever run a shape came from
    runs = {s["shape"]: merged["runs"][s["run"]]["commit"] for s in merged["shapes"]}
    assert runs == {"A": "abc1234", "B": "def5678", "C": "abc1234"}
    assert json.loads(open(path).read()) == merged
    # a rerun of every shape leaves one run: nothing of the earlier ones stays behind
    _, again = results.publish(_report(order, commit="0000000"), out, "hidden 64, 1 thread", order)
    assert [r["commit"] for r in again["runs"]] == ["0000000"]
    manifest = json.loads(open(os.path.join(out, "manifest.json")).read())
    assert [e["json"] for e in manifest["bench"]] == ["bench_cpu_h64_heads4_kv2_t1.json"]
    # the table reads the folder; its line names the run behind the numbers
    table = markdown([out])
    assert "**2.00x**" in table and "commit 0000000; 2026-12-07" in table


def test_configurations_are_files_of_their_own(tmp_path):
    out = str(tmp_path)
    results.publish(_report(["A"]), out, "t1")
    results.publish(_report(["A"], threads=2), out, "t2")
    results.publish(_report(["A"], hidden=32), out, "h32")
    names = [e["name"] for e in json.loads(open(os.path.join(out, "manifest.json")).read())["bench"]]
    assert names == ["bench_cpu_h32_heads4_kv2_t1", "bench_cpu_h64_heads4_kv2_t1", "bench_cpu_h64_heads4_kv2_t2"]
    with pytest.raises(ValueError, match="cannot merge"):
        results.merge(_report(["A"]), _report(["A"], threads=2))


def test_config_line_of_several_runs():
    merged = results.merge(results.merge(None, _report(["A", "B"])), _report(["B"], commit="def5678"))
    line = config_line(merged)
    assert "2 runs (commit abc1234, def5678; 2026-12-07)" in line and "load 0.50 at the start" in line


def test_committed_results_folder_is_complete():
    """Every configuration the manifest lists has its file and plot; every other entry its file."""
    folder = os.path.join(ROOT, "results")
    manifest = json.loads(open(os.path.join(folder, "manifest.json")).read())
    assert manifest["bench"], "no configuration listed"
    for entry in manifest["bench"]:
        report = json.loads(open(os.path.join(folder, entry["json"])).read())
        assert results.configuration_name(report) == entry["name"] and report["runs"], entry
        assert os.path.isfile(os.path.join(folder, entry["plot"])), entry
    for entry in manifest["other"]:
        for name in [entry["file"], *entry.get("plots", [])]:
            assert os.path.isfile(os.path.join(folder, name)), entry
    listed = {e[k] for e in manifest["bench"] for k in ("json", "plot")}
    listed |= {n for e in manifest["other"] for n in [e["file"], *e.get("plots", [])]}
    assert set(os.listdir(folder)) - {"manifest.json"} == listed  # nothing unlisted: no run history by file name


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "megatron_branch.cli", "bench", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def test_bench_table_reads_the_manifest():
    proc = _cli("--table")
    assert proc.returncode == 0, proc.stderr
    entries = json.loads(open(os.path.join(ROOT, "results", "manifest.json")).read())["bench"]
    assert all(f"{entry['label']}, 2 layers" in proc.stdout for entry in entries)  # each one's config line
    assert proc.stdout.count("| ours: % of ideal (speed-up of ideal) |") == 1


@pytest.mark.parametrize("args, message", [
    (["--table"], "--table: no results/manifest.json"),  # run where there is no results folder
    (["--publish", "--quick"], "--publish: a --quick run"),
    (["--table", "nowhere"], "--table nowhere: no such file"),
])
def test_bench_results_bad_input_is_one_line(args, message, tmp_path):
    proc = _cli(*args, cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
