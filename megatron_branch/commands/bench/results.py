"""The results folder: one current ``bench.json`` (and plot) per configuration, and a manifest.

A *configuration* is what a run's ratios hold for: the device, the model width (hidden size,
attention heads, key/value groups) and the torch threads. ``results/`` holds one file per
configuration, named by :func:`configuration_name`, and ``manifest.json`` lists them (and the
other committed results, each with the command that writes it). ``megatron-branch bench
--publish`` replaces a configuration's shapes with the new run's (a run of a few shapes keeps
the others, so a configuration can be covered by several runs: each shape records its run in
``runs``), and ``megatron-branch bench --table`` renders the manifest's runs. History lives in
git, never in file names.

Layout of a published file: the bench report (``config``, ``shapes``, …) plus ``runs``, one
entry per run that contributed a shape (``commit``, ``date``, repeats, torch and megatron-core
versions, machine), and ``"run": i`` on each shape.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_branch.atomic import write_text_atomically

MANIFEST = "manifest.json"
DEFAULT_DIR = "results"
# what a run entry keeps of a report (its top-level facts, as opposed to per-shape results)
_RUN_FIELDS = ("commit", "date", "torch_version", "megatron_core_version", "machine", "method_order", "allocator",
               "seconds_main", "seconds_total")


def configuration_name(report: dict) -> str:
    """``bench_cpu_h128_heads4_kv2_t1``: the file stem of the configuration ``report`` ran."""
    c = report["config"]
    return (f"bench_{report.get('device', 'cpu')}_h{c['hidden_size']}_heads{c['num_attention_heads']}_"
            f"kv{c['num_query_groups']}_t{report['torch_threads']}")


def source_commit() -> Optional[str]:
    """The package checkout's commit (``+dirty`` with uncommitted changes), or None outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def stamp(report: dict) -> dict:
    """Record when and from which commit ``report`` was run (in place; returns it)."""
    report.setdefault("commit", source_commit())
    report.setdefault("date", datetime.date.today().isoformat())
    return report


def _run_entry(report: dict) -> dict:
    entry = {k: report[k] for k in _RUN_FIELDS if k in report}
    entry["repeats"] = report["config"]["repeats"]
    return entry


def _as_published(report: dict) -> dict:
    """``report`` in the published layout (a file already in it is returned as is)."""
    if "runs" in report:
        return report
    out = {k: v for k, v in report.items() if k not in _RUN_FIELDS}
    out["runs"] = [_run_entry(report)]
    out["shapes"] = [dict(s, run=0) for s in report["shapes"]]
    return out


def merge(old: Optional[dict], new: dict, order: Sequence[str] = ()) -> dict:
    """``new``'s shapes replace ``old``'s of the same name; the rest of ``old`` stays.

    The shapes are listed in ``order`` (the bench's shape names; others after them, new
    before old). The optional sections (``profile``, ``peer``, ``thd``) are replaced when
    ``new`` has them. Raises ValueError when the two are not the same configuration.
    """
    new = _as_published(new)
    old = _as_published(old) if old is not None else dict(new, shapes=[], runs=[])
    if configuration_name(old) != configuration_name(new):
        raise ValueError(f"cannot merge {configuration_name(new)} into {configuration_name(old)}")
    names = {s["shape"] for s in new["shapes"]}
    kept = [s for s in old["shapes"] if s["shape"] not in names]
    runs: List[dict] = []
    index: Dict[int, int] = {}  # old run index -> merged index, for the runs still referenced

    def keep_run(run: dict) -> int:
        runs.append(run)
        return len(runs) - 1

    for s in kept:
        if s["run"] not in index:
            index[s["run"]] = keep_run(old["runs"][s["run"]])
    shift = {i: keep_run(run) for i, run in enumerate(new["runs"])}
    shapes = [dict(s, run=index[s["run"]]) for s in kept] + [dict(s, run=shift[s["run"]]) for s in new["shapes"]]
    ranked = list(order) + [s["shape"] for s in new["shapes"]] + [s["shape"] for s in old["shapes"]]
    shapes.sort(key=lambda s: ranked.index(s["shape"]))
    merged = dict(old)
    merged.update({k: v for k, v in new.items() if v and k not in ("shapes", "runs", "config")})
    merged.update(shapes=shapes, runs=runs)
    merged["config"] = dict(new["config"], shapes=_union(old["config"]["shapes"], new["config"]["shapes"]))
    merged.pop("skipped_shapes", None)
    skipped = [s for s in new.get("skipped_shapes", []) if s["shape"] not in {x["shape"] for x in shapes}]
    if skipped:
        merged["skipped_shapes"] = skipped
    return merged


def _union(old: List[dict], new: List[dict]) -> List[dict]:
    names = {s["name"] for s in new}
    return [s for s in old if s["name"] not in names] + list(new)


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return {"bench": [], "other": []}
    with open(path) as f:
        return json.load(f)


def manifest_paths(directory: str, flag: str = "--table") -> List[str]:
    """The bench files the manifest in ``directory`` lists, in its order."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: no {path}; run from the repository root or pass bench.json files")
    return [os.path.join(directory, entry["json"]) for entry in read_manifest(directory)["bench"]]


def _sort_key(entry: dict) -> tuple:
    return entry.get("device", "cpu"), entry["hidden_size"], entry["threads"], entry["name"]


def publish(report: dict, directory: str, label: str, order: Sequence[str] = ()) -> Tuple[str, dict]:
    """Merge ``report`` into its configuration's file in ``directory`` (:func:`merge`, shapes in
    ``order``) and list it in the manifest; returns the file's path and the merged report.
    ``label`` is the table's column title; the plot beside the file is the caller's."""
    os.makedirs(directory, exist_ok=True)
    name = configuration_name(report)
    path = os.path.join(directory, name + ".json")
    old = None
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
    merged = merge(old, stamp(report) if "runs" not in report else report, order)
    write_text_atomically(path, json.dumps(merged, indent=1) + "\n")
    manifest = read_manifest(directory)
    entries = [e for e in manifest.get("bench", []) if e["name"] != name]
    c = merged["config"]
    entries.append({"name": name, "label": label, "device": merged.get("device", "cpu"),
                    "hidden_size": c["hidden_size"], "threads": merged["torch_threads"], "json": name + ".json",
                    "plot": name + ".png"})
    manifest["bench"] = sorted(entries, key=_sort_key)
    write_text_atomically(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1) + "\n")
    return path, merged
