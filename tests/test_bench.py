"""``megatron-branch bench``: a tiny shape runs, the JSON schema, the exactness column."""

import json
import subprocess
import sys

import pytest
from megatron.core import package_info

from megatron_branch.commands.bench.run import (
    BenchConfig,
    Shape,
    format_table,
    plot,
    run_bench,
    select_shapes,
    timing_order,
)
from megatron_branch.flops import ModelShape, causal_pairs, step_flops

TREE_METHODS = {"packed", "prompt_once", "dense_tree", "ours", "ours_stream", "ours_stream_small"}


def tiny_config(**kw):
    kw.setdefault("allocator", "default")  # the test process's allocator stays as it is
    return BenchConfig(
        hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128, chunk_tokens=48,
        repeats=3, threads=1, shapes=[Shape("G=4", [64], [4], [16]), Shape("multi", [32], [2, 3], [8, 8]),
                           Shape("agentic", [16] * 2, [3, 3], [4, 4])], **kw,
    )


def _check_spread(d):
    assert set(d) == {"median", "min", "max"}, d
    assert d["min"] <= d["median"] <= d["max"], d


def test_tiny_bench_report(tmp_path):
    from megatron_branch.commands.bench.methods import naive_micro_batches

    report = run_bench(tiny_config(profile_shapes=["G=4"]), echo=lambda *_: None)
    assert report["schema_version"] == 2
    assert report["torch_version"] and report["machine"]["cpus"] >= 1  # what the timings ran on
    # 0.16.1 and 0.19.2 runs differ; no git suffix (0.19 appends the commit of the repo around the venv)
    assert report["megatron_core_version"] == package_info.__version__.split("+")[0]
    assert report["config"]["allocator"] == "default" and report["allocator"].startswith("default: ")
    assert len(report["shapes"]) == 3
    for shape in report["shapes"]:
        assert shape["unique_positions"] < shape["naive_positions"]
        assert shape["ideal_flop_ratio"] > 1
        rows = {r["method"]: r for r in shape["methods"]}
        num = shape["rollouts"]
        sweep = {f"naive_mb{k}" for k in naive_micro_batches(num)}
        assert set(rows) == TREE_METHODS | sweep, set(rows)
        assert shape["naive_reference"] in sweep
        # the reference is the fastest naive micro-batching by median time
        best = min(sweep, key=lambda n: rows[n]["seconds"]["median"])
        assert shape["naive_reference"] == best
        for r in rows.values():
            assert r["kernel"] and r["flops"] > 0
            assert r["max_rel_grad_diff"] < 1e-5, (shape["shape"], r)  # every method is exact vs naive_mb1
            _check_spread(r["seconds"])
            _check_spread(r["speedup"])
            assert r["seconds"]["min"] > 0 and r["peak_memory_bytes"] > 0
            assert abs(r["fraction_of_ideal"]["median"] * shape["ideal_flop_ratio"] - r["speedup"]["median"]) < 1e-9
        assert rows[shape["naive_reference"]]["speedup"] == {"median": 1.0, "min": 1.0, "max": 1.0}
        # padding: micro-batches of one rollout run exactly the rollouts' positions
        assert rows["naive_mb1"]["positions"] == shape["naive_positions"]
        assert rows["ours"]["flops"] < rows["naive_mb1"]["flops"]
        # streaming rows: their units and their cost against one pass, per chunk
        # the bench's budget (48) raised to the longest segment (the G=4 prompt: 64); an eighth of it
        for name, budget in (("ours_stream", 64 if shape["shape"] == "G=4" else 48), ("ours_stream_small", 16)):
            r = rows[name]
            assert r["chunk_tokens"] == budget and r["chunks"] >= 1, r
            _check_spread(r["fraction_of_one_pass"])
            _check_spread(r["seconds_per_chunk"]), _check_spread(r["seconds_per_unit"])
            # both spread one excess per repeat: over the chunks, and over the units after the first
            for k in ("median", "min", "max"):
                excess = r["seconds_per_chunk"][k] * r["chunks"]
                assert abs(r["seconds_per_unit"][k] * max(r["chunks"] + r["stems"] - 1, 1) - excess) < 1e-9, r
            # the fixed-cost bound against one pass: at most one pass's speed, 100% with one unit
            _check_spread(r["one_pass_bound"]), _check_spread(r["fraction_of_one_pass_bound"])
            assert 0 < r["one_pass_bound"]["max"] <= 1.0 + 1e-12, r
        units = {n: rows[n]["chunks"] + rows[n]["stems"] for n in ("ours_stream", "ours_stream_small")}
        # the stock stack's cost per pass, timed in every repeat, and ours against the speed-up it allows
        _check_spread(shape["fixed_cost_seconds"]), _check_spread(shape["fixed_cost_ours_seconds"])
        assert 0 < shape["fixed_cost_seconds"]["max"] < rows[shape["naive_reference"]]["seconds"]["max"]
        _check_spread(rows["ours"]["fixed_cost_bound"]), _check_spread(rows["ours"]["fraction_of_bound"])
        assert rows["ours"]["fixed_cost_bound"]["min"] > 1
        assert units["ours_stream_small"] > units["ours_stream"], units  # stems may also run whole subtrees
    assert next(s for s in report["shapes"] if s["shape"] == "agentic")["segments"] >= 2 * (1 + 3 + 9)  # random tokens: siblings may share a first token
    prof = report["profile"][0]
    assert prof["shape"] == "G=4" and prof["ours_wall_seconds"] > 0
    total = sum(r["ours_seconds"] for r in prof["rows"])
    assert abs(total - prof["ours_wall_seconds"]) < 1e-6 * max(1.0, total) + 1e-9  # categories + overhead = wall
    # each category also at naive's own cost per unit of work: attention per pair, the rest per position
    w = prof["work_ratios"]
    assert w["positions"] > 1 and w["pairs"] > 1, w
    for r in prof["rows"]:
        ratio = w["pairs"] if r["category"] == "attention kernel" else w["positions"]
        assert abs(r["naive_rate_seconds"] * ratio - r["naive_seconds"]) <= 1e-9 * max(1.0, r["naive_seconds"]), r
    assert abs(prof["naive_rate_ours_seconds"] - sum(r["naive_rate_seconds"] for r in prof["rows"])) < 1e-9
    table = format_table(report)
    assert "ideal FLOP ratio" in table and "ours_stream" in table and "naive_mb4" in table
    assert "where ours' gap" in table and "[" in table and "ms per chunk" in table
    assert "ms per unit after the first" in table and "ours' one pass on it" in table
    assert "at naive's own cost per unit of work" in table
    plot(report, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    # the published tables are rendered from the JSON (megatron-branch bench --table)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report))
    proc = subprocess.run([sys.executable, "-m", "megatron_branch.cli", "bench", "--table", str(path), str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # streaming's cost per unit beside the fixed cost of a pass (S and ours' own)
    assert "streaming per unit after the first" in proc.stdout
    first = report["shapes"][0]
    stream = next(r for r in first["methods"] if r["method"] == "ours_stream")
    stock, own = (1e3 * first[k]["median"] for k in ("fixed_cost_seconds", "fixed_cost_ours_seconds"))
    per_unit, units = 1e3 * stream["seconds_per_unit"]["median"], stream["chunks"] + stream["stems"]
    assert f"| {stock:.1f} / {own:.1f} / {per_unit:+.1f} ({units}) |" in proc.stdout
    ours = next(r for r in report["shapes"][0]["methods"] if r["method"] == "ours")
    assert f"**{ours['speedup']['median']:.2f}x**" in proc.stdout  # the run's own number
    assert "hidden 64 (4 heads / 2 KV), 1 thread" in proc.stdout and "% of one pass" in proc.stdout
    # two run tables, the comparison (ours, streaming), the fixed-cost bounds and the cost per streaming unit
    assert proc.stdout.count("| G=4 |") == 6
    assert "% of bound" in proc.stdout and "fixed cost of a pass through the stack" in table
    # the profile's categories, once per run that has them, with the run's own numbers
    assert proc.stdout.count("where ours' gap goes (--profile; seconds)") == 2
    attn = next(r for r in prof["rows"] if r["category"] == "attention kernel")
    assert f"| attention kernel | {attn['naive_over_ideal_seconds']:.3f} | {attn['naive_rate_seconds']:.3f} | " in proc.stdout
    assert "the real peer (--peer)" not in proc.stdout  # this run has no peer section


def test_timing_order_gives_every_method_varying_neighbours():
    """The first repeat times the listed order; later ones are seeded shuffles (the same on
    every run), so no method is timed after the same neighbour in every repeat."""
    names = [f"m{i}" for i in range(14)]
    orders = [timing_order(names, r) for r in range(5)]
    assert orders[0] == names
    assert all(sorted(o) == sorted(names) for o in orders)
    assert orders == [timing_order(names, r) for r in range(5)]  # reproducible
    for name in names:
        before = {o[o.index(name) - 1] if o.index(name) else None for o in orders}
        assert len(before) > 1, (name, before)
    assert timing_order([], 3) == []


def test_fixed_cost_bounds_by_hand():
    from megatron_branch.commands.bench.fixed_cost import add_bounds, one_pass_bound, speedup_bound

    # naive 10 s in 2 micro-batches of 1 s fixed cost each; ideal 4x: 1 + 8 / 4 = 3 s at best
    assert speedup_bound(10.0, 1.0, 2, 4.0) == pytest.approx(10 / 3)
    assert speedup_bound(10.0, 0.0, 2, 4.0) == pytest.approx(4.0)  # no fixed cost: the ideal ratio
    # fewer passes than naive's micro-batches: the bound can exceed the ideal ratio
    assert speedup_bound(16.0, 0.5, 16, 4.0) == pytest.approx(16 / (0.5 + 8 / 4))
    assert one_pass_bound(1.0, 0.1, 1) == 1.0 and one_pass_bound(1.0, 0.1, 3) == pytest.approx(1 / 1.2)
    with pytest.raises(ValueError, match="ideal"):
        speedup_bound(1.0, 0.1, 1, 0.0)
    rows = [{"method": "naive_mb2"}, {"method": "ours"}, {"method": "ours_stream", "chunks": 2, "stems": 1}]
    times = {"naive_mb2": [10.0, 12.0], "ours": [4.0, 3.0], "ours_stream": [5.0, 3.2]}
    add_bounds(rows, "naive_mb2", 4, 4.0, times, [1.0, 0.5])  # 4 rollouts in micro-batches of 2: k = 2
    ours, stream = rows[1], rows[2]
    b0, b1 = 10 / (1 + 8 / 4), 12 / (0.5 + 11 / 4)
    assert ours["fixed_cost_bound"]["min"] == pytest.approx(min(b0, b1))
    assert ours["fraction_of_bound"]["max"] == pytest.approx(max((10 / 4) / b0, (12 / 3) / b1))
    assert stream["one_pass_bound"]["max"] == pytest.approx(max(4 / 6, 3 / 4))
    assert stream["fraction_of_one_pass_bound"]["median"] == pytest.approx(((4 / 5) / (4 / 6) + (3 / 3.2) / (3 / 4)) / 2)
    assert "fixed_cost_bound" not in rows[0]


def test_bench_table_runs_of_one_configuration_share_a_column():
    """A run of the remaining shapes at a configuration fills that configuration's column;
    another configuration keeps its own, and a shape no run of a column has shows '-'."""
    from megatron_branch.commands.bench.table import bound_table, comparison_table

    def run(hidden, shapes):
        methods = lambda f: [  # noqa: E731
            {"method": "ours", "fraction_of_ideal": {"median": f}, "speedup": {"median": 5 * f},
             "fraction_of_bound": {"median": f}, "fixed_cost_bound": {"median": 5.0}},
            {"method": "ours_stream", "fraction_of_one_pass": {"median": f}}]
        return {"config": {"hidden_size": hidden, "num_attention_heads": 4, "num_query_groups": 2},
                "torch_threads": 2, "shapes": [{"shape": n, "ideal_flop_ratio": 5.0, "methods": methods(f),
                                                "fixed_cost_seconds": {"median": 0.004}} for n, f in shapes]}

    first, rest, other = run(512, [("A", 0.91)]), run(512, [("B", 0.82), ("A", 0.5)]), run(128, [("A", 0.97)])
    ours, stream = comparison_table([first, rest, other]).split("\n\n")
    head, rule, row_a, row_b = ours.splitlines()
    assert head == "| ours: % of ideal (speed-up of ideal) | hidden 512, 2 threads | hidden 128, 2 threads |"
    assert rule == "|---|" + "---|" * 2
    assert row_a == "| A | 91% (4.55x of 5.00x) | 97% (4.85x of 5.00x) |"  # the first run of the column that has A
    assert row_b == "| B | 82% (4.10x of 5.00x) | - |"
    assert stream.splitlines()[2:] == ["| A | 91% | 97% |", "| B | 82% | - |"]
    bounds = bound_table([first, rest, other]).splitlines()
    assert len(bounds[1].split("---")) == 4 and bounds[3].startswith("| B | 4.0; 82% of 5.00x | - |")


@pytest.mark.parametrize("content, message", [
    (None, "no such file"), ("{", "not valid JSON"), ('{"a": 1}', "not a bench report"),
])
def test_bench_table_bad_input_is_one_line(content, message, tmp_path):
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "megatron_branch.cli", "bench", "--table", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "--table" in lines[0], proc.stderr


def test_select_shapes_whole_name_selects_itself_alone():
    shapes = BenchConfig.full().shapes
    names = lambda wanted: [s.name for s in select_shapes(shapes, wanted)]  # noqa: E731
    assert names(["G=16 p/r=1"]) == ["G=16 p/r=1"]  # not also p/r=16 and the MoE / GDN rows
    assert names(["g=16 P/R=16"]) == ["G=16 p/r=16"]
    assert names(["G=16 p/r"]) == ["G=16 p/r=16", "G=16 p/r=1", "G=16 p/r=4", "MoE 8x top-2, G=16 p/r=16",
                                   "GDN hybrid, G=16 p/r=16"]
    assert names(["agentic", "G=4 "]) == ["G=4 p/r=16", "agentic forest 4x128, 3 turns x16, 4-way"]
    with pytest.raises(ValueError, match=r"\['nope'\] match no shape"):
        select_shapes(shapes, ["G=4 ", "nope"])


def test_quick_config_shapes():
    quick, full = BenchConfig.quick(), BenchConfig.full()
    # the published runs take 5 paired repeats: medians of 3 moved shapes by 10-25 points between runs
    assert quick.repeats >= 3 and full.repeats >= 5
    for cfg in (quick, full):
        names = [s.name for s in cfg.shapes]
        assert any("agentic" in n for n in names) and any("no sharing" in n for n in names)
    full_shapes = {s.name: s for s in full.shapes}
    forest = full_shapes["agentic forest 4x128, 3 turns x16, 4-way"].batch(full.vocab_size, 0)
    from megatron_branch.tree import BranchTree

    assert len(forest.sequences) == 256
    assert len(BranchTree.from_sequences(forest.sequences).segments) >= 300
    long = full_shapes["16x(4096+96)"].batch(full.vocab_size, 0)
    assert len(long.sequences) == 16 and set(long.lengths) == {4096 + 96}


def test_peer_prefix_grouper_is_exact():
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[peer])")
    pytest.importorskip("prefix_grouper", reason="prefix_grouper is not installed (pip install -e .[peer])")
    from megatron_branch.commands.bench.peer import format_peer, run_peer
    from megatron_branch.commands.bench.table import peer_table
    from megatron_branch.cpu import enable_cpu
    from megatron_branch.distributed import init_distributed

    enable_cpu()
    init_distributed()
    cfg = tiny_config(peer=True, peer_shapes=[Shape("G=4", [48], [4], [12]), Shape("2 prompts", [40, 50], [3], [9])])
    peer = run_peer(cfg, echo=lambda *_: None)
    assert "mb_sdpa_varlen" in peer["inner_attention"]
    for s in peer["shapes"]:
        rows = {r["method"]: r for r in s["methods"]}
        assert {"prefix_grouper", "ours", "hf_naive_mb1", "megatron_naive_mb1"} <= set(rows)
        assert s["hf_naive_reference"].startswith("hf_naive_mb")
        assert s["megatron_naive_reference"].startswith("megatron_naive_mb")
        for key in ("ours_over_peer", "framework_cost", "method_ratio"):  # paired ratios
            _check_spread(s[key])
        for name, r in rows.items():
            _check_spread(r["seconds"])
            _check_spread(r["speedup"])
            assert r["max_rel_grad_diff"] < 1e-5, (s["shape"], name, r)
        # log-probs of the response tokens agree with every rollout run through HF alone
        assert rows["prefix_grouper"]["max_abs_logprob_diff"] < 1e-5
        assert rows["ours"]["max_abs_logprob_diff"] < 1e-5
    assert "prefix_grouper" in format_peer(peer) and "framework per-position cost" in format_peer(peer)
    table = peer_table({"peer": peer})  # bench --table: one row per shape, its paired ours-over-peer median
    for shape in peer["shapes"]:
        assert f"| {shape['shape']} | {shape['position_ratio']:.2f}x |" in table
        assert f"{shape['ours_over_peer']['median']:.2f}x (" in table


def test_sdpa_varlen_matches_per_sequence_causal():
    """The CPU stand-in for flash-attn's padded path: prefix + suffix keys with padding."""
    import torch
    import torch.nn.functional as F

    from megatron_branch.commands.bench.peer import sdpa_varlen_attention

    torch.manual_seed(0)
    b, h, d, sk, sq = 2, 2, 8, 10, 4
    q, k, v = torch.randn(b, h, sq, d), torch.randn(b, h, sk, d), torch.randn(b, h, sk, d)
    # row 0: prefix 3 of 6 valid, suffix 4 of 4; row 1: prefix 6 of 6, suffix 2 of 4
    mask = torch.zeros(b, sk, dtype=torch.bool)
    mask[0, :3] = True
    mask[0, 6:] = True
    mask[1, :6] = True
    mask[1, 6:8] = True
    out, _ = sdpa_varlen_attention(None, q, k, v, mask, scaling=d ** -0.5)
    for i in range(b):
        keys = mask[i].nonzero()[:, 0]
        nq = int(mask[i, -sq:].sum())
        qi = q[i, :, :nq]
        ref = F.scaled_dot_product_attention(qi, k[i, :, keys], v[i, :, keys], scale=d ** -0.5,
                                             attn_mask=torch.ones(nq, len(keys), dtype=torch.bool).tril(
                                                 len(keys) - nq))
        torch.testing.assert_close(out[i, :nq].transpose(0, 1), ref)
        assert out[i, nq:].abs().max() == 0 if nq < sq else True


def test_flops_by_hand():
    shape = ModelShape(num_layers=1, hidden_size=4, num_attention_heads=2, num_query_groups=1,
                       ffn_hidden_size=8, vocab_size=10, gated=True)
    # qkv 4*(4+2*2)=32, proj 16, mlp 4*8*3=96 -> 144 params; output 40
    flops = step_flops(shape, positions=3, attention_pairs=causal_pairs(3))
    assert flops["linear"] == 6 * 3 * (144 + 40)
    assert flops["attention"] == 12 * 6 * 2 * 2
    assert flops["total"] == flops["linear"] + flops["attention"]


def test_bench_cli_help():
    proc = subprocess.run([sys.executable, "-m", "megatron_branch.cli", "bench", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--quick" in proc.stdout
    assert all(flag in proc.stdout for flag in ("--threads", "--hidden", "--heads", "--kv-groups"))


@pytest.mark.parametrize("flags, message", [
    (["--threads", "0"], "--threads: must be >= 1, got 0"),
    (["--hidden", "-4"], "--hidden: must be >= 1, got -4"),
    (["--heads", "3"], "--heads 3 does not divide --hidden 128"),
    (["--hidden", "256", "--heads", "8", "--kv-groups", "3"], "--kv-groups 3 does not divide --heads 8"),
    (["--shapes", "agentic", "nope"], "--shapes: ['nope'] match no shape"),
    (["--allocator", "jemalloc"], "argument --allocator: invalid choice: 'jemalloc'"),
])
def test_bench_bad_model_flags_are_one_line_before_anything_runs(flags, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_branch.cli", "bench", "--out", str(tmp_path / "o"), *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "o").exists()  # nothing ran


def test_bench_cp_tiny():
    from megatron_branch.commands.bench.cp import format_table, run_bench_cp

    report = run_bench_cp(True, sizes=(1, 2), echo=lambda *_: None,
                          shape=dict(prompt=64, tails=4, tail_len=8, repeats=1))
    rows = {(r["cp"], r["comm"]): r for r in report["rows"]}
    assert set(rows) == {(1, "allgather"), (2, "allgather"), (2, "p2p")}
    assert rows[(1, "allgather")]["bytes_sent_per_rank"] == [0]
    assert all(b > 0 for b in rows[(2, "allgather")]["bytes_sent_per_rank"])
    # p2p skips the shard pair with no visible (query, key) pair: rank 0 never needs rank 1's keys
    assert sum(rows[(2, "p2p")]["bytes_sent_per_rank"]) < sum(rows[(2, "allgather")]["bytes_sent_per_rank"])
    assert sum(rows[(2, "p2p")]["attention_pairs"]) == sum(rows[(1, "allgather")]["attention_pairs"])
    assert "MB sent" in format_table(report)


def test_moe_shape_is_exact_and_reports_the_ideal_ratio():
    cfg = BenchConfig(hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128, chunk_tokens=48,
                      repeats=1, moe_experts=4, moe_topk=2,
                      shapes=[Shape("MoE 4x top-2, G=4", [64], [4], [16], moe=True)])
    report = run_bench(cfg, methods=["naive", "prompt_once", "ours", "ours_stream"], echo=lambda *_: None)
    shape = report["shapes"][0]
    rows = {r["method"]: r for r in shape["methods"]}
    # MoE: one naive batch (the router's load-balancing statistics are per batch)
    assert set(rows) == {"naive_mb4", "prompt_once", "ours", "ours_stream"}
    assert shape["ideal_flop_ratio"] > 1
    for r in rows.values():
        # router statistics weighted by multiplicity: every method equals the naive MoE batch
        assert r["max_rel_grad_diff"] < 1e-5, r
        assert r["speedup"]["median"] > 0 and "fraction_of_ideal" in r
    assert "MoE 4x top-2" in format_table(report)


def test_the_thd_drop_in_section_reports_a_paired_ratio_and_agrees():
    from megatron_branch.commands.bench.run import _models
    from megatron_branch.commands.bench.thd import run_thd

    cfg = tiny_config()
    rows = run_thd(_models(cfg)["cascade"], cfg.vocab_size, [dict(seqs=3, prompt=12, response=8, shared=False),
                                                             dict(seqs=3, prompt=12, response=8, shared=True)],
                   repeats=2, echo=lambda *_: None)
    for row in rows:
        _check_spread(row["ratio_ours_over_stock"])
        assert row["max_abs_logprob_diff"] < 1e-5 and row["tokens"] == 60


def test_gdn_hybrid_shape_is_exact_and_reports_the_ideal_ratio():
    from megatron_branch._megatron import gdn_unavailable_reason

    cfg = BenchConfig(hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128, chunk_tokens=48,
                      repeats=1, shapes=[Shape("GDN hybrid, G=4", [64], [4], [16], hybrid=True)])
    report = run_bench(cfg, methods=["naive", "ours", "ours_stream"], echo=lambda *_: None)
    if gdn_unavailable_reason():  # megatron-core 0.16: the shape is reported as skipped, with the reason
        assert report["skipped_shapes"] == [{"shape": "GDN hybrid, G=4", "skipped": gdn_unavailable_reason()}]
        return
    shape = report["shapes"][0]
    rows = {r["method"]: r for r in shape["methods"]}
    assert {"ours", "ours_stream"} <= set(rows) and any(m.startswith("naive_mb") for m in rows)
    # attention pairs count in the attention layer only: the ideal ratio sits between the
    # position ratio and the all-attention model's
    assert 1 < shape["ideal_flop_ratio"]
    for r in rows.values():
        assert r["max_rel_grad_diff"] < 1e-3, r  # float32 chunk kernel: vanishing decay gradients move at rounding
    assert "GDN hybrid" in format_table(report)


def test_naive_sweep_tries_every_power_of_two_and_the_whole_group():
    from megatron_branch.commands.bench.methods import naive_micro_batches

    assert naive_micro_batches(32) == [1, 2, 4, 8, 16, 32]
    assert naive_micro_batches(12) == [1, 2, 4, 8, 12]
    assert naive_micro_batches(1) == [1]
    assert naive_micro_batches(16, moe=True) == [16]


KEEP_PROBE = """
import resource, sys
import torch
from megatron_branch.commands.bench.allocator import keep_freed_memory

def refaults():  # minor page faults of re-allocating a 64 MiB tensor just freed
    torch.ones(16 << 20).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = min(refaults() for _ in range(3))
said = keep_freed_memory()
kept = min(refaults() for _ in range(3))  # steady state: the heap's layout settles in a call or two
print(default, kept, said)
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_stops_refaulting_large_tensors():
    # In a fresh process (the setting lasts for the process): glibc maps a 64 MiB block anew on
    # every allocation (16384 pages faulted again), and after keep_freed_memory reuses it.
    # Up to three fresh processes: one CI run in many saw a process re-fault the block even
    # after the setting (16384 pages in all three calls; not reproduced in 30 runs
    # since), so a single process's layout is not taken as the verdict. The test still fails
    # if the setting never stops the re-faulting.
    outputs = []
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", KEEP_PROBE], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        default, kept, said = proc.stdout.split(maxsplit=2)
        assert int(default) > 10000, proc.stdout  # the probe can see the effect
        assert said.startswith("keep: glibc keeps freed memory")
        outputs.append(proc.stdout.strip())
        if int(kept) < 1000:
            return
    raise AssertionError(f"freed 64 MiB tensors re-faulted after keep_freed_memory in 3 processes: {outputs}")


def test_unknown_allocator_setting_is_a_value_error():
    from megatron_branch.commands.bench import allocator

    with pytest.raises(ValueError, match="--allocator: 'jemalloc' is not one of"):
        allocator.apply("jemalloc")
    assert allocator.apply("default").startswith("default: ")  # changes nothing


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_elsewhere(capsys):
    from megatron_branch.commands.progress import Progress

    # pytest's captured stderr is no terminal: one plain line per update (every=0), none on stderr
    with Progress(3, "bench", every=0) as bar:
        for note in ("a", "b", "c"):
            bar.update(note)
    out, err = capsys.readouterr()
    assert err == "" and out.splitlines()[-1].startswith("bench 3/3 ") and len(out.splitlines()) == 3
    assert "\r" not in out
    # lines are at most one per `every` seconds, and the last always shows
    with Progress(3, "study", every=1e9) as bar:
        for _ in range(3):
            bar.update()
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == ["1/3", "3/3"]
    with Progress(2, "bench", verbose=True) as bar:  # --verbose: the bar, wherever stderr goes
        bar.update("x")
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("\rbench [") and err.endswith("\n")


def test_profiler_output_is_silenced_unless_verbose(capfd):
    import torch

    from megatron_branch.commands.bench.profile import OVERHEAD, _profile

    x = torch.randn(32, 32, requires_grad=True)

    def step():
        (x @ x).sum().backward()

    capfd.readouterr()
    out = _profile(step, lambda: None)
    assert out["wall"] > 0 and OVERHEAD in out
    assert capfd.readouterr() == ("", "")  # Kineto writes its USDT/STAGE lines to fd 2 directly
    print("still here")  # the descriptors are back
    assert capfd.readouterr().out == "still here\n"
