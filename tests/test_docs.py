"""The front door stays short and its links stay true: README and docs/benchmarks.md sizes,
and every relative link or results file the docs name exists."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                         if f.endswith(".md")]


def _read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_front_door_sizes():
    assert len(_read("README.md").encode()) <= 12 * 1024
    assert len(_read("docs/benchmarks.md").split()) <= 4000


@pytest.mark.parametrize("page", PAGES)
def test_links_and_results_files_exist(page):
    text, here = _read(page), os.path.dirname(os.path.join(ROOT, page))
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):  # markdown links and images
        if "://" not in target:
            assert os.path.exists(os.path.join(here, target)), f"{page}: broken link {target}"
    for name in re.findall(r"results/([\w.-]+\.(?:json|png))", text):
        assert os.path.isfile(os.path.join(ROOT, "results", name)), f"{page}: names missing results/{name}"
