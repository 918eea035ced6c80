"""Markdown tables from committed ``bench.json`` files (``megatron-branch bench --table``).

The README's and ``docs/benchmarks.md``'s tables are this module's output on the results
folder (``results/manifest.json``, :mod:`megatron_branch.commands.bench.results`), so the
published numbers are exactly the measured ones: one detailed
table per run (:func:`run_table`) and one comparison across runs, a column per
configuration (:func:`comparison_table`), the fixed-cost bounds (:func:`bound_table`), what
a streaming unit costs against a pass (:func:`unit_cost_table`), and
for a run that has them, where ours' gap goes (:func:`profile_table`, ``--profile``) and the
real peer (:func:`peer_table`, ``--peer``).
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence

from megatron_branch.commands.bench.results import DEFAULT_DIR, manifest_paths


def report_paths(paths: Sequence[str]) -> List[str]:
    """The bench files ``--table`` names: a results folder (or its ``manifest.json``) stands
    for the files its manifest lists; no argument means ``results/``."""
    if not paths:
        return manifest_paths(DEFAULT_DIR)
    out: List[str] = []
    for path in paths:
        if os.path.isdir(path):
            out += manifest_paths(path)
        elif os.path.basename(path) == "manifest.json":
            out += manifest_paths(os.path.dirname(path) or ".")
        else:
            out.append(path)
    return out


def load(paths: Sequence[str]) -> List[dict]:
    reports = []
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        if not isinstance(report, dict) or "shapes" not in report or "config" not in report:
            raise ValueError(f"--table {path}: not a bench report (no 'shapes'/'config'); pass a bench.json that "
                             "megatron-branch bench wrote")
        reports.append(report)
    return reports


def config_label(report: dict) -> str:
    """``hidden 128 (4 heads / 2 KV), 1 thread``: the settings a run's ratios hold for."""
    c = report["config"]
    threads = report.get("torch_threads")
    return (f"hidden {c['hidden_size']} ({c['num_attention_heads']} heads / {c['num_query_groups']} KV), "
            f"{threads} thread{'s' if threads != 1 else ''}")


def _runs(report: dict) -> List[dict]:
    """The runs behind ``report``: a published file lists them; a fresh report is one."""
    if "runs" in report:
        return report["runs"]
    return [dict(report, repeats=report["config"]["repeats"])]


def _distinct(values) -> str:
    seen = [str(v) for v in dict.fromkeys(values) if v is not None]
    return ", ".join(seen) if seen else "?"


def config_line(report: dict) -> str:
    """One line on what the run (or the runs of a published file) ran on."""
    runs = _runs(report)
    loads = [r["machine"]["load_average"][0] for r in runs if (r.get("machine") or {}).get("load_average")]
    spread_s = f"{min(loads):.2f}" + (f"–{max(loads):.2f}" if max(loads) > min(loads) else "") if loads else ""
    load_s = f", load {spread_s} at the start" if loads else ""
    cores = _distinct(r.get("megatron_core_version") for r in runs)  # absent from the earliest runs
    core_s = f", megatron-core {cores}" if cores != "?" else ""
    cpus = _distinct((r.get("machine") or {}).get("cpus") for r in runs)
    source = ""
    if any(r.get("commit") for r in runs):
        source = (f", {len(runs)} run{'s' if len(runs) > 1 else ''} (commit {_distinct(r.get('commit') for r in runs)};"
                  f" {_distinct(sorted(r.get('date') or '' for r in runs))})")
    shuffled = " (shuffled)" if all("method_order" in r for r in runs) else ""
    return (f"{config_label(report)}, {report['config']['num_layers']} layers, fp32, torch "
            f"{_distinct(r.get('torch_version') for r in runs)}{core_s}, {cpus} CPUs{load_s}{source}, "
            f"{_distinct(r['repeats'] for r in runs)} interleaved repeats{shuffled}, "
            f"chunk budget {report['config']['chunk_tokens']}, "
            f"host allocator {_distinct(r.get('allocator', 'default').split(':')[0] for r in runs)}")


def _rows(shape: dict) -> dict:
    return {r["method"]: r for r in shape["methods"]}


def _shape_names(reports: Sequence[dict]) -> List[str]:
    """Every shape of the runs, in the order first met."""
    names: List[str] = []
    for r in reports:
        names += [s["shape"] for s in r["shapes"] if s["shape"] not in names]
    return names


def _columns(reports: Sequence[dict]) -> List[tuple]:
    """``(label, runs)`` per configuration, in the order first met: runs of one
    configuration (e.g. a run of the remaining shapes) share a column, each shape from the
    first of them that ran it."""
    columns: dict = {}
    for r in reports:
        columns.setdefault(config_label(r), []).append(r)
    return list(columns.items())


def _shape(runs: Sequence[dict], name: str) -> Optional[dict]:
    return next((s for r in runs for s in r["shapes"] if s["shape"] == name), None)


def _speed(row: dict) -> str:
    if not row or "speedup" not in row:
        return "skipped"
    return f"{row['speedup']['median']:.2f}x"


def run_table(report: dict) -> str:
    """One run: speed-up vs the fastest naive per method, median (min-max) for ours."""
    lines = [config_line(report), "",
             "| shape | rollouts / segments | ideal | naive mb | **ours** | % of ideal | ours_stream "
             "(% of one pass) | small budget: ms per chunk | prompt_once | packed | dense_tree |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["shapes"]:
        rows = _rows(s)
        ours, stream, small = rows.get("ours", {}), rows.get("ours_stream", {}), rows.get("ours_stream_small", {})
        sp = ours.get("speedup")
        ours_s = f"**{sp['median']:.2f}x** ({sp['min']:.2f}–{sp['max']:.2f})" if sp else "skipped"
        frac = f"{100 * ours['fraction_of_ideal']['median']:.0f}%" if sp else "-"
        stream_s = _speed(stream)
        if "fraction_of_one_pass" in stream:
            stream_s += f" ({100 * stream['fraction_of_one_pass']['median']:.0f}%)"
        small_s = (f"{1e3 * small['seconds_per_chunk']['median']:+.1f} ({small['chunks']} chunks)"
                   if "seconds_per_chunk" in small else "-")
        ref = s.get("naive_reference") or "-"
        lines.append(f"| {s['shape']} | {s['rollouts']} / {s.get('segments', '?')} | {s['ideal_flop_ratio']:.2f}x | "
                     f"{ref.replace('naive_mb', '')} | {ours_s} | {frac} | {stream_s} | {small_s} | "
                     f"{_speed(rows.get('prompt_once'))} | {_speed(rows.get('packed'))} | "
                     f"{_speed(rows.get('dense_tree'))} |")
    for s in report.get("skipped_shapes", []):
        lines.append(f"| {s['shape']} | skipped: {s['skipped']} | | | | | | | | | |")
    return "\n".join(lines)


def short_label(report: dict) -> str:
    """``hidden 128, 1 thread``: a column title (the config line gives heads and the rest)."""
    threads = report.get("torch_threads")
    return f"hidden {report['config']['hidden_size']}, {threads} thread{'s' if threads != 1 else ''}"


def comparison_table(reports: Sequence[dict]) -> str:
    """Two tables, a column per configuration (:func:`_columns`): ours' fraction of the ideal
    ratio (with the speed-up and the ideal), then streaming's fraction of one pass."""
    columns = _columns(reports)
    titles = " | ".join(short_label(runs[0]) for _, runs in columns)
    rule = "|---|" + "---|" * len(columns)
    ours_lines = [f"| ours: % of ideal (speed-up of ideal) | {titles} |", rule]
    stream_lines = [f"| streaming: % of one pass | {titles} |", rule]
    for name in _shape_names(reports):
        cells_ours, cells_stream = [], []
        for _, runs in columns:
            s = _shape(runs, name)
            rows = _rows(s) if s else {}
            ours, stream = rows.get("ours", {}), rows.get("ours_stream", {})
            if "fraction_of_ideal" in ours:
                f = ours["fraction_of_ideal"]
                cells_ours.append(f"{100 * f['median']:.0f}% ({ours['speedup']['median']:.2f}x of "
                                  f"{s['ideal_flop_ratio']:.2f}x)")
            else:
                cells_ours.append("-")
            f = stream.get("fraction_of_one_pass")
            cells_stream.append(f"{100 * f['median']:.0f}%" if f else "-")
        ours_lines.append(f"| {name} | " + " | ".join(cells_ours) + " |")
        stream_lines.append(f"| {name} | " + " | ".join(cells_stream) + " |")
    return "\n".join(ours_lines) + "\n\n" + "\n".join(stream_lines)


def bound_table(reports: Sequence[dict]) -> str:
    """Against the fixed-cost bounds (``fixed_cost.py``): the stack's cost per pass ``S``,
    ours' fraction of the speed-up a method with the ideal work and ``S`` once could reach,
    and streaming's of one pass with ``S`` per unit; a column per configuration whose runs
    measured ``S`` (:func:`_columns`)."""
    reports = [r for r in reports if any("fixed_cost_seconds" in s for s in r["shapes"])]
    if not reports:
        return ""
    columns = _columns(reports)
    head = ("| S ms; ours, % of bound; streaming, % of bound | "
            + " | ".join(short_label(runs[0]) for _, runs in columns) + " |")
    lines = [head, "|---|" + "---|" * len(columns)]
    names = _shape_names(reports)
    for name in names:
        cells = []
        for _, runs in columns:
            s = _shape(runs, name)
            rows = _rows(s) if s else {}
            ours, stream = rows.get("ours", {}), rows.get("ours_stream", {})
            if not s or "fixed_cost_seconds" not in s or "fraction_of_bound" not in ours:
                cells.append("-")
                continue
            cell = (f"{1e3 * s['fixed_cost_seconds']['median']:.1f}; {100 * ours['fraction_of_bound']['median']:.0f}% "
                    f"of {ours['fixed_cost_bound']['median']:.2f}x")
            if "fraction_of_one_pass_bound" in stream:
                cell += (f"; {100 * stream['fraction_of_one_pass_bound']['median']:.0f}% of "
                         f"{100 * stream['one_pass_bound']['median']:.0f}%")
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def unit_cost_table(reports: Sequence[dict]) -> str:
    """What streaming pays per unit after the first, beside the fixed cost of a pass: the
    stock stack's ``S`` and ours' one pass on the same two-token rollout (tree, plan and
    scoring included), per shape; a column per configuration whose runs recorded ours'
    fixed cost (from 89bfeb2 on)."""
    reports = [r for r in reports if any("fixed_cost_ours_seconds" in s for s in r["shapes"])]
    if not reports:
        return ""
    columns = _columns(reports)
    head = ("| S / ours' pass / streaming per unit after the first, ms (units) | "
            + " | ".join(short_label(runs[0]) for _, runs in columns) + " |")
    lines = [head, "|---|" + "---|" * len(columns)]
    for name in _shape_names(reports):
        cells = []
        for _, runs in columns:
            s = _shape(runs, name)
            stream = _rows(s).get("ours_stream", {}) if s else {}
            if not s or "fixed_cost_ours_seconds" not in s or "seconds_per_unit" not in stream:
                cells.append("-")
                continue
            cells.append(f"{1e3 * s['fixed_cost_seconds']['median']:.1f} / "
                         f"{1e3 * s['fixed_cost_ours_seconds']['median']:.1f} / "
                         f"{1e3 * stream['seconds_per_unit']['median']:+.1f} ({stream['chunks'] + stream['stems']})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _spread(x: dict) -> str:
    return f"{x['median']:.2f}x ({x['min']:.2f}–{x['max']:.2f})"


def profile_table(report: dict) -> str:
    """``--profile``: ours' time per category against naive's divided by the ideal ratio."""
    profiles = report.get("profile") or []
    if not profiles:
        return ""
    lines = ["| shape (ours' gap) | category | naive ÷ ideal | at naive's rate | ours | excess |",
             "|---|---|---|---|---|---|"]
    for p in profiles:
        for i, r in enumerate(p["rows"]):
            head = (f"{p['shape']} ({p['gap_seconds']:+.3f} s; {100 * p['fraction_of_ideal_profiled']:.0f}% of ideal, "
                    f"{100 * p['fraction_of_naive_rate_profiled']:.0f}% of naive's rate)") if i == 0 else ""
            lines.append(f"| {head} | {r['category']} | {r['naive_over_ideal_seconds']:.3f} | "
                         f"{r['naive_rate_seconds']:.3f} | {r['ours_seconds']:.3f} | {r['excess_seconds']:+.3f} |")
    return "\n".join(lines)


def peer_table(report: dict) -> str:
    """``--peer``: ours and the real ``prefix_grouper`` against HF naive, and the
    framework's per-position cost measured apart from the method (paired medians, min–max)."""
    peer = report.get("peer") or {}
    if not peer.get("shapes"):
        return ""
    lines = ["| shape | position ratio | prefix_grouper | ours | ours / peer | Megatron / HF naive per position | "
             "method alone | log-prob / grad diff vs HF naive (peer; ours) |",
             "|---|---|---|---|---|---|---|---|"]
    for s in peer["shapes"]:
        rows = _rows(s)
        if "ours_over_peer" not in s:
            lines.append(f"| {s['shape']} | not run | | | | | | |")
            continue
        pg, ours = rows["prefix_grouper"], rows["ours"]
        diffs = "; ".join(f"{r['max_abs_logprob_diff']:.1e} / {r['max_rel_grad_diff']:.1e}" for r in (pg, ours))
        lines.append(f"| {s['shape']} | {s['position_ratio']:.2f}x | {_spread(pg['speedup'])} | "
                     f"{_spread(ours['speedup'])} | {_spread(s['ours_over_peer'])} | "
                     f"{s['framework_cost']['median']:.2f}x | {_spread(s['method_ratio'])} | {diffs} |")
    return "\n".join(lines)


def markdown(paths: Sequence[str]) -> str:
    """Every run's table, then (for several runs) the comparison, the fixed-cost bounds of the
    runs that measured them, and the profile and peer tables of the runs that have them.
    ``paths``: bench files or results folders (:func:`report_paths`)."""
    paths = report_paths(paths)
    reports = load(paths)
    parts = [f"{path}:\n\n{run_table(r)}" for path, r in zip(paths, reports)]
    if len(reports) > 1:
        parts.append(comparison_table(reports))
    parts += [t for t in (bound_table(reports), unit_cost_table(reports)) if t]
    for title, render in (("where ours' gap goes (--profile; seconds)", profile_table),
                          ("the real peer (--peer)", peer_table)):
        parts += [f"{path}, {title}:\n\n{t}" for path, r in zip(paths, reports) if (t := render(r))]
    return "\n\n".join(parts)
