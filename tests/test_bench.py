"""``megatron-branch bench``: a tiny shape runs, the JSON schema, the exactness column."""

import json
import subprocess
import sys

from megatron_branch.flops import ModelShape, causal_pairs, step_flops
from megatron_branch.bench.run import BenchConfig, Shape, format_table, plot, run_bench

METHODS = {"naive", "packed", "prompt_once", "dense_tree", "ours", "ours_stream"}


def tiny_config():
    return BenchConfig(
        hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128, chunk_tokens=48,
        repeats=1, shapes=[Shape("G=4", [64], [4], [16]), Shape("multi", [32], [2, 3], [8, 8])],
    )


def test_tiny_bench_report(tmp_path):
    report = run_bench(tiny_config(), echo=lambda *_: None)
    assert report["schema_version"] == 1
    assert len(report["shapes"]) == 2
    for shape in report["shapes"]:
        assert shape["unique_positions"] < shape["naive_positions"]
        assert shape["ideal_flop_ratio"] > 1
        rows = {r["method"]: r for r in shape["methods"]}
        assert set(rows) == METHODS
        for r in rows.values():
            assert r["kernel"] and r["flops"] > 0
            assert r["max_rel_grad_diff"] < 1e-5, (shape["shape"], r)  # every method is exact
            assert r["seconds"] > 0 and r["peak_memory_bytes"] > 0 and r["speedup"] > 0
        assert rows["naive"]["speedup"] == 1.0
        assert rows["ours"]["flops"] < rows["naive"]["flops"]
    table = format_table(report)
    assert "ideal FLOP ratio" in table and "ours_stream" in table
    plot(report, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    json.dumps(report)


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


def test_bench_cp_tiny():
    from megatron_branch.bench.cp import format_table, run_bench_cp

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
    assert set(rows) == {"naive", "prompt_once", "ours", "ours_stream"}
    assert shape["ideal_flop_ratio"] > 1
    for r in rows.values():
        # router statistics weighted by multiplicity: every method equals the naive MoE batch
        assert r["max_rel_grad_diff"] < 1e-5, r
        assert r["speedup"] > 0 and "fraction_of_ideal" in r
    assert "MoE 4x top-2" in format_table(report)
