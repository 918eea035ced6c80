"""The checkpoint converter (``tools/convert_checkpoint.py``) fails cleanly and loses nothing.

Real files and real processes, a tiny Llama (1 layer, hidden 32):

* bad input (a truncated safetensors file, a config.json without a field or of an
  unsupported architecture, a tensor of the wrong shape or missing, a missing or corrupt
  Megatron checkpoint for export, an ``--hf-config`` of another model) is one line naming
  the file or flag, exit code 2, no traceback unless ``--debug``; an unexpected failure
  is one line, exit code 1, and leaves nothing behind;
* the target (non-empty without ``--overwrite``, a file, unwritable) is checked before
  torch.distributed is initialised, so before the model is built or a weight is read;
* a conversion SIGKILLed in the middle of its write leaves no process behind and no
  target; the next run removes its temporary directory (and says so) and succeeds;
  SIGTERM removes it at once.

Most cases call the tool's ``main`` in this process (the same code path as the command
line, in a fraction of the time); a bad-input case and the kills run it as a subprocess.
"""

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megatron_branch.atomic import host_tag
from megatron_branch.hf import io as hf_io
from megatron_branch.hf.convert import FAULT_ENV, load_megatron

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")
_spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOL)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=64, max_position_embeddings=64)
SUPPORTED = ("LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, "
             "MixtralForCausalLM, DeepseekV3ForCausalLM, Qwen3NextForCausalLM, Glm4MoeForCausalLM, Qwen3_5ForCausalLM, "
             "Qwen3_5MoeForCausalLM")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "hf"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).float().save_pretrained(path)
    return path


@pytest.fixture
def hf(tiny_hf, tmp_path):
    """A fresh copy of the tiny HF checkpoint to break."""
    return shutil.copytree(tiny_hf, tmp_path / "hf")


def convert(capsys, *args):
    """Run the tool's ``main`` in this process: (exit code, stderr lines)."""
    capsys.readouterr()
    code = tool.main([str(a) for a in args])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def run_tool(*args, env=None):
    return subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=dict(os.environ, **(env or {})))


def leftovers(directory):
    return [n for n in os.listdir(directory) if ".tmp-" in n or ".old-" in n]


def edit_config(hf, fn):
    cfg = json.loads((hf / "config.json").read_text())
    fn(cfg)
    (hf / "config.json").write_text(json.dumps(cfg))


def edit_weights(hf, fn):
    state = load_file(hf / "model.safetensors")
    fn(state)
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})


# ----------------------------------------------------------------------------- bad input
def test_truncated_safetensors_is_one_line_and_exit_2(hf, tmp_path):
    weights = hf / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    proc = run_tool("import", "--hf-model", hf, "--megatron-path", tmp_path / "mg")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"convert_checkpoint import: error: {weights}: not a readable safetensors file (Error while deserializing "
        "header: incomplete metadata, file not fully covered); it is truncated or corrupt, download or copy it again"
    ], proc.stderr[-3000:]
    assert not (tmp_path / "mg").exists() and not leftovers(tmp_path)


def _drop_config(hf):
    os.remove(hf / "config.json")


BAD_IMPORTS = {
    "missing_config": (_drop_config, "--hf-model {hf}: has no config.json; pass a Hugging Face model directory"),
    "config_not_json": (lambda hf: (hf / "config.json").write_text("{oops"),
                        "--hf-model {hf}/config.json: not valid JSON (Expecting property name enclosed in double "
                        "quotes"),
    "missing_config_key": (lambda hf: edit_config(hf, lambda c: c.pop("num_attention_heads")),
                           "{hf}/config.json: lacks num_attention_heads (needed for LlamaForCausalLM); pass the "
                           "model's complete config.json"),
    "unsupported_architecture": (lambda hf: edit_config(hf, lambda c: c.update(architectures=["GPT2LMHeadModel"])),
                                 "{hf}/config.json: architecture 'GPT2LMHeadModel' is not supported (supported: "
                                 + SUPPORTED + ")"),
    "wrong_shape": (lambda hf: edit_weights(hf, lambda s: s.update(
        {"model.layers.0.self_attn.o_proj.weight": torch.zeros(32, 16)})),
        "{hf}/model.safetensors: tensor 'model.layers.0.self_attn.o_proj.weight' has shape [32, 16], config.json "
        "implies [32, 32]; the weights do not belong to this config"),
    "missing_tensor": (lambda hf: edit_weights(hf, lambda s: s.pop("model.layers.0.mlp.up_proj.weight")),
                       "--hf-model {hf}: missing tensor 'model.layers.0.mlp.up_proj.weight'; the checkpoint does not "
                       "match its config.json"),
    "unexpected_tensor": (lambda hf: edit_weights(hf, lambda s: s.update({"model.extra.weight": torch.zeros(2)})),
                          "--hf-model {hf}: unexpected tensors ['model.extra.weight']"),
    "pickle_only": (lambda hf: (os.remove(hf / "model.safetensors"), (hf / "pytorch_model.bin").write_bytes(b"x")),
                    "--hf-model {hf}: has no *.safetensors weights (found pytorch_model.bin: pickle checkpoints are "
                    "not loaded; re-save with safetensors)"),
}


@pytest.mark.parametrize("case", list(BAD_IMPORTS))
def test_bad_import_input_is_one_line_and_exit_2(case, hf, tmp_path, capsys):
    breaker, expected = BAD_IMPORTS[case]
    breaker(hf)
    code, err = convert(capsys, "import", "--hf-model", hf, "--megatron-path", tmp_path / "mg")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("convert_checkpoint import: error: " + expected.format(hf=hf)), err
    assert not (tmp_path / "mg").exists() and not leftovers(tmp_path)


def test_debug_adds_the_traceback(hf, tmp_path, capsys):
    edit_config(hf, lambda c: c.pop("vocab_size"))
    code, err = convert(capsys, "import", "--hf-model", hf, "--megatron-path", tmp_path / "mg", "--debug")
    assert code == 2 and err[0] == "Traceback (most recent call last):", err
    assert err[-1] == (f"convert_checkpoint import: error: {hf}/config.json: lacks vocab_size (needed for "
                       "LlamaForCausalLM); pass the model's complete config.json")


@pytest.fixture(scope="module")
def imported(tiny_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("imported") / "mg"
    assert tool.main(["import", "--hf-model", str(tiny_hf), "--megatron-path", str(out)]) == 0
    return out


def _truncate_shard(mg):
    shard = next(p for p in mg.iterdir() if p.suffix == ".distcp")
    with open(shard, "r+b") as f:
        f.truncate(100)


BAD_EXPORTS = {
    "missing_checkpoint": (lambda mg: shutil.rmtree(mg),
                           "--megatron-path {mg}: no such directory; pass a directory written by "
                           "`convert_checkpoint.py import`"),
    "not_a_converted_checkpoint": (lambda mg: os.remove(mg / "model_args.json"),
                                   "--megatron-path {mg}: has no model_args.json; not a checkpoint written by"),
    "corrupt_model_args": (lambda mg: (mg / "model_args.json").write_text("garbage"),
                           "{mg}/model_args.json: corrupt (Expecting value: line 1 column 1 (char 0)); run the import "
                           "again"),
    "incomplete_checkpoint": (lambda mg: os.remove(mg / "metadata.json"),
                              "--megatron-path {mg}: has no metadata.json; the distributed checkpoint is incomplete, "
                              "run the import again"),
    "truncated_shard": (_truncate_shard, "--megatron-path {mg}: cannot be loaded ("),  # the cause varies by version
}


@pytest.mark.parametrize("case", list(BAD_EXPORTS))
def test_bad_export_input_is_one_line_and_exit_2(case, imported, tmp_path, capsys):
    mg = shutil.copytree(imported, tmp_path / "mg")
    breaker, expected = BAD_EXPORTS[case]
    breaker(mg)
    code, err = convert(capsys, "export", "--megatron-path", mg, "--hf-model", tmp_path / "out")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("convert_checkpoint export: error: " + expected.format(mg=mg)), err
    if case == "truncated_shard":
        assert err[0].endswith("the checkpoint is incomplete or corrupt, run the import again"), err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_export_with_another_models_config_is_refused(imported, hf, tmp_path, capsys):
    edit_config(hf, lambda c: c.update(hidden_size=64, num_hidden_layers=2))
    code, err = convert(capsys, "export", "--megatron-path", imported, "--hf-model", tmp_path / "out",
                        "--hf-config", hf)
    assert code == 2 and err == [
        f"convert_checkpoint export: error: --hf-config {hf}: describes another model than --megatron-path "
        f"{imported} (hidden_size 64 vs 32, num_layers 2 vs 1); pass the config it was imported from"], err
    assert not (tmp_path / "out").exists()


def test_an_unexpected_failure_is_one_line_exit_1_and_leaves_nothing(hf, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "raise-after-write")
    code, err = convert(capsys, "import", "--hf-model", hf, "--megatron-path", tmp_path / "mg")
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"convert_checkpoint import: error: RuntimeError: injected failure after writing "
                             f"{tmp_path}/.mg.tmp-{os.getpid()}-"), err
    assert err[0].endswith(f"({FAULT_ENV}) [--debug shows the traceback]"), err
    assert not (tmp_path / "mg").exists() and not leftovers(tmp_path)


# --------------------------------------------------------------------------------- target
def test_target_is_checked_before_torch_distributed(hf, tmp_path, capsys, monkeypatch):
    """An occupied target is refused before init_distributed runs: an invalid
    $MEGATRON_BRANCH_TIMEOUT, which init_distributed reads first, is not reached; with a
    free target it is."""
    (tmp_path / "mg").mkdir()
    (tmp_path / "mg" / "keep.txt").write_text("keep me")
    monkeypatch.setenv("MEGATRON_BRANCH_TIMEOUT", "soon")
    code, err = convert(capsys, "import", "--hf-model", hf, "--megatron-path", tmp_path / "mg")
    assert code == 2 and err == [
        f"convert_checkpoint import: error: --megatron-path {tmp_path / 'mg'}: exists and is not empty; pass "
        "--overwrite to replace it or choose another directory"], err
    assert os.listdir(tmp_path / "mg") == ["keep.txt"] and (tmp_path / "mg" / "keep.txt").read_text() == "keep me"
    code, err = convert(capsys, "import", "--hf-model", hf, "--megatron-path", tmp_path / "free")
    assert code == 2 and err == ["convert_checkpoint import: error: MEGATRON_BRANCH_TIMEOUT='soon': must be a "
                                 "positive number of seconds"], err
    assert not (tmp_path / "free").exists() and not leftovers(tmp_path)


def test_bad_targets_are_one_line_and_exit_2(hf, imported, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    unwritable = "/proc/megatron-branch-test/mg" if os.geteuid() == 0 else None
    if unwritable is None:
        (tmp_path / "ro").mkdir(mode=0o555)
        unwritable = str(tmp_path / "ro" / "mg")
    cases = [
        (("import", "--hf-model", hf, "--megatron-path", tmp_path / "file"),
         f"--megatron-path {tmp_path / 'file'}: is a file, not a directory; choose a directory"),
        (("import", "--hf-model", hf, "--megatron-path", unwritable), f"--megatron-path {unwritable}: "),
        (("import", "--hf-model", hf, "--megatron-path", hf, "--overwrite"),
         f"--megatron-path {hf}: is the --hf-model directory; choose another"),
        (("export", "--megatron-path", imported, "--hf-model", hf),
         f"--hf-model {hf}: exists and is not empty; pass --overwrite to replace it or choose another directory"),
        (("export", "--megatron-path", imported, "--hf-model", tmp_path / "out", "--max-shard-gb", "0"),
         "--max-shard-gb: must be > 0, got 0.0"),
    ]
    for args, expected in cases:
        code, err = convert(capsys, *args)
        assert code == 2 and len(err) == 1 and f"error: {expected}" in err[0], (args, err)
        if unwritable in args:
            assert err[0].endswith("; choose a writable directory"), err
    assert (tmp_path / "file").read_text() == "x" and (hf / "config.json").is_file()
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_overwrite_replaces_and_export_round_trips(tiny_hf, imported, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    code, err = convert(capsys, "export", "--megatron-path", imported, "--hf-model", out, "--overwrite",
                        "--hf-config", tiny_hf)
    assert code == 0 and err == [], err
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"] and not leftovers(tmp_path)
    back, want = load_file(out / "model.safetensors"), load_file(tiny_hf / "model.safetensors")
    assert set(back) == set(want) and all(torch.equal(back[k], want[k]) for k in want)


# ------------------------------------------------------------------------ stale temp dirs
def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_our_dead_runs_temp_dirs_are_cleaned(tmp_path):
    """Named like atomic_dir's: a dead owner's partial output is removed and a previous
    target it had moved aside is put back; a live owner's directory (this process) and
    directories not named by atomic_dir are left alone."""
    host, dead, me = host_tag(), _dead_pid(), os.getpid()
    start = int(psutil.Process().create_time())
    names = {
        "dead_tmp": f".mg.tmp-{dead}-1-{host}-abc123xy",
        "dead_old": f".mg.old-{dead}-1-{host}-zz9_0abc",
        "live_tmp": f".mg.tmp-{me}-{start}-{host}-live0000",
        "foreign": ".mg.tmp-notours",
        "other_target": f".other.tmp-{dead}-1-{host}-abc123xy",
    }
    for key, name in names.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "data").write_text(key)
    told = []
    with pytest.raises(ValueError, match="mg: exists and is not empty; pass --overwrite"):  # the restored one
        hf_io.check_target(str(tmp_path / "mg"), False, "--megatron-path", told.append)
    assert told == [
        f"restored {tmp_path / 'mg'} from {tmp_path / names['dead_old']}, moved aside by an interrupted --overwrite "
        f"(process {dead} is gone)",
        f"removed {tmp_path / names['dead_tmp']}, the partial output of an interrupted conversion (process {dead} is "
        "gone)",
    ]
    assert (tmp_path / "mg" / "data").read_text() == "dead_old"
    assert sorted(os.listdir(tmp_path)) == sorted(["mg", names["live_tmp"], names["foreign"], names["other_target"]])


# ------------------------------------------------------------------------------- kills
def _start_paused_import(hf, target, tag):
    env = dict(os.environ, **{FAULT_ENV: "pause-after-write", "CONVERT_FAULTS_TEST_TAG": tag})
    proc = subprocess.Popen([sys.executable, TOOL, "import", "--hf-model", str(hf), "--megatron-path", str(target)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines, paused = [], threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line.rstrip())
            if line.startswith(f"{FAULT_ENV}: paused"):
                paused.set()

    threading.Thread(target=read, daemon=True).start()
    children = set()
    deadline = time.monotonic() + 90
    while not paused.is_set() and proc.poll() is None and time.monotonic() < deadline:
        try:
            children |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.05)
    assert paused.is_set(), "\n".join(lines[-30:])
    children |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
    return proc, lines, children


def _tagged(tag):
    """Processes started by the conversion (they inherit its environment), wherever they
    were re-parented."""
    found = []
    for p in psutil.process_iter(["environ", "status", "cmdline"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and (p.info["environ"] or {}).get("CONVERT_FAULTS_TEST_TAG") == tag:
            found.append(p)
    return found


def _assert_nothing_survives(tag, children):
    deadline = time.monotonic() + 5
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = _tagged(tag)
    described = [(p.pid, " ".join(p.info["cmdline"] or [])[:120]) for p in survivors]
    for p in survivors:  # do not leak them into the rest of the session
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not survivors, f"left behind: {described}"
    assert not children, f"the conversion started processes: {sorted(children)}"


def test_sigkill_mid_write_leaves_no_process_and_the_next_run_cleans_up(hf, tmp_path, capsys):
    target, tag = tmp_path / "mg", uuid.uuid4().hex
    proc, lines, children = _start_paused_import(hf, target, tag)
    temp = [n for n in os.listdir(tmp_path) if n.startswith(".mg.tmp-")]
    assert len(temp) == 1 and any(n.endswith(".distcp") for n in os.listdir(tmp_path / temp[0])), temp
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    _assert_nothing_survives(tag, children)
    assert not target.exists() and os.path.isdir(tmp_path / temp[0])

    code, err = convert(capsys, "import", "--hf-model", hf, "--megatron-path", target)
    assert code == 0, err
    assert err == [f"convert_checkpoint: removed {tmp_path / temp[0]}, the partial output of an interrupted "
                   f"conversion (process {proc.pid} is gone)"]
    assert not leftovers(tmp_path)
    model, _ = load_megatron(str(target))
    want = load_file(hf / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.embedding.word_embeddings.weight.detach(), want)


def test_sigterm_mid_write_removes_the_partial_output(hf, tmp_path):
    target, tag = tmp_path / "mg", uuid.uuid4().hex
    proc, lines, children = _start_paused_import(hf, target, tag)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".mg.tmp-")]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    time.sleep(0.2)  # let the reader thread take the last line
    assert lines[-1] == ("convert_checkpoint: stopped by SIGTERM; the target is written only by a finished "
                         "conversion (the partial output is removed)"), lines
    assert not any("Traceback" in line for line in lines), lines
    _assert_nothing_survives(tag, children)
    assert not target.exists() and not leftovers(tmp_path)
