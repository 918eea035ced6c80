"""The package's layering rules (tests/layering.py) hold, and the check can fail.

The rules are checked on the source of ``megatron_branch``; each is then broken on
purpose in a small package written to a temporary directory, and the check must name it.
"""

import os
import textwrap

import layering

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_branch")


def test_the_package_keeps_its_layering():
    problems = layering.check_package(ROOT)
    assert problems == [], "\n".join(problems)


def test_every_module_is_in_a_layer():
    for module in layering._modules(ROOT):
        layering.layer_of(module)  # raises KeyError naming a module no layer holds


def _package(tmp_path, files):
    root = tmp_path / "megatron_branch"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(root)


def test_a_planted_cycle_is_found(tmp_path):
    root = _package(tmp_path, {
        "replay/__init__.py": "",
        "replay/step.py": "from megatron_branch.replay.plan import plan\n",
        "replay/plan.py": "def plan():\n    # lazy: planted for the test\n    from megatron_branch.replay import step\n",
    })
    problems = layering.check_package(root)
    assert any("import cycle megatron_branch.replay.plan -> megatron_branch.replay.step" in p for p in problems), problems


def test_a_planted_cycle_in_the_real_package_is_found(tmp_path):
    # the real package, copied, with one back edge added: tree (data) -> replay (replay)
    import shutil

    copy = tmp_path / "megatron_branch"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    tree = copy / "tree.py"
    tree.write_text(tree.read_text() + "\n\ndef _planted():\n    # planted for the test\n"
                    "    from megatron_branch.replay.plan import plan_replay  # noqa: F401\n")
    problems = layering.check_package(str(copy))
    assert any("import cycle" in p and "megatron_branch.tree" in p for p in problems), problems
    assert any("megatron_branch.tree (data) imports megatron_branch.replay.plan (replay)" in p for p in problems)


def test_upward_private_and_unexplained_imports_are_found(tmp_path):
    root = _package(tmp_path, {
        "tree.py": "from megatron_branch.scoring.unit import _private_helper\n",
        "scoring/__init__.py": "",
        "scoring/unit.py": textwrap.dedent('''
            def _private_helper():
                pass


            def late():
                from megatron_branch import tree
                return tree
        '''),
        "spec/__init__.py": "",
        "spec/layer.py": textwrap.dedent('''
            def bind(params, router):
                params._memo = {}
                self_like = router
                self_like._tree = None
        '''),
    })
    problems = layering.check_package(root)
    text = "\n".join(problems)
    assert "megatron_branch.tree (data) imports megatron_branch.scoring.unit (scoring), a higher layer" in text
    assert "imports the private name _private_helper from megatron_branch.scoring.unit" in text
    assert "imports megatron_branch.tree inside a function without a reason" in text
    assert "writes the private attribute _memo of another object" in text
    assert "writes the private attribute _tree of another object" in text


def test_counts_for_the_record():
    counts = layering.stats(ROOT)
    assert counts["cycles"] == 0 and counts["private_imports"] == 0
    assert counts["top_level_modules"] <= 15
