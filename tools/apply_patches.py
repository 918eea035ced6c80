"""Check (and optionally apply) the patches under ``patches/`` against an upstream checkout.

    python tools/apply_patches.py --checkout ~/src/Megatron-LM --upstream megatron-lm [--apply]

Patches live in ``patches/<upstream>-<version>/NNNN-topic.patch``. A folder may hold an
``UPSTREAM`` file (``repository: URL``, ``tag: TAG``, ``commit: SHA``); such a folder is
used only for a checkout whose ``HEAD`` is that commit or carries that tag (a folder for
a branch such as Megatron-LM's ``main`` names its commit and no tag). With
``--upstream``, a checkout that matches none of that upstream's folders is refused,
naming its own tags and commit and the versions that do have patches. Every selected
patch is checked with ``git apply --check`` in the checkout (in name order); ``--apply``
applies them once all check cleanly. Patches already applied (``git apply --reverse
--check`` succeeds) are reported and left alone, so ``--apply`` can be repeated. Exit
code 1 if any patch does not apply or no folder matches the checkout, 2 if
``--checkout`` is not a git checkout.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
from typing import Dict, List, Optional

PATCHES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patches")


def read_upstream(folder: str) -> Dict[str, str]:
    """The ``key: value`` lines of ``folder/UPSTREAM`` (empty if there is none)."""
    path = os.path.join(folder, "UPSTREAM")
    if not os.path.isfile(path):
        return {}
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            key, sep, value = line.partition(":")
            if sep and not line.startswith("#"):
                out[key.strip()] = value.strip()
    return out


def checkout_tags(checkout: str) -> List[str]:
    """The tags that point at the checkout's ``HEAD``."""
    res = subprocess.run(["git", "tag", "--points-at", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return res.stdout.split() if res.returncode == 0 else []


def checkout_commit(checkout: str) -> str:
    """The full SHA of the checkout's ``HEAD`` ("" if it has none)."""
    res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else ""


def matches(upstream: Dict[str, str], tags: List[str], commit: str) -> bool:
    """True if a folder's ``UPSTREAM`` fields name the checkout (no fields: any checkout)."""
    if not upstream.get("tag") and not upstream.get("commit"):
        return True
    pinned = upstream.get("commit", "")
    return upstream.get("tag") in tags or (bool(pinned) and bool(commit) and commit.startswith(pinned))


def describe(upstream: Dict[str, str]) -> str:
    """A folder's version as a person names it: its tag, else its commit."""
    return upstream.get("tag") or f"commit {upstream.get('commit', '?')[:10]}"


def _git_apply(checkout: str, patch: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "apply", *flags, patch], cwd=checkout, capture_output=True, text=True)


def is_applied(checkout: str, patch: str) -> bool:
    """True if ``patch`` is already applied in ``checkout`` (it reverses cleanly)."""
    return _git_apply(checkout, patch, "--reverse", "--check").returncode == 0


def patches_applied(checkout: str, folder: str) -> bool:
    """True if every patch of ``folder`` is applied in ``checkout``."""
    patches = sorted(glob.glob(os.path.join(folder, "*.patch")))
    return bool(patches) and all(is_applied(checkout, p) for p in patches)


def folder_upstream(name: str) -> str:
    """The upstream a folder ``<upstream>-<version>`` is for (``megatron-lm-main-d98e8a64dd``:
    ``megatron-lm``; a version is ``core_vX.Y.Z``, ``main-SHA`` or a bare word)."""
    base, _, version = name.rpartition("-")
    if base.endswith("-main"):  # megatron-lm-main-<sha>
        base = base[: -len("-main")]
    return base if version else name


def select_folders(root: str, upstream: Optional[str], tags: List[str], commit: str = ""):
    """``(folders to use, versions of the folders skipped for another checkout)``."""
    chosen, other = [], []
    for folder in sorted(glob.glob(os.path.join(root, "*-*"))):
        name = os.path.basename(folder)
        if not os.path.isdir(folder) or (upstream is not None and folder_upstream(name) != upstream):
            continue
        fields = read_upstream(folder)
        if matches(fields, tags, commit):
            chosen.append(folder)
        else:
            other.append(describe(fields))
    return chosen, other


def folder_for(checkout: str, upstream: str, root: str = PATCHES) -> Optional[str]:
    """The one patch folder of ``upstream`` for ``checkout`` (None if no folder fits)."""
    chosen, _ = select_folders(root, upstream, checkout_tags(checkout), checkout_commit(checkout))
    return chosen[0] if len(chosen) == 1 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", required=True, help="the upstream git checkout")
    p.add_argument("--upstream", default=None, help="only patches/<upstream>-<version>/ folders")
    p.add_argument("--patches", default=PATCHES, help="patch root (default: this repo's patches/)")
    p.add_argument("--apply", action="store_true", help="apply after every patch checked cleanly")
    args = p.parse_args(argv)
    if not os.path.isdir(os.path.join(args.checkout, ".git")) and not os.path.isfile(
            os.path.join(args.checkout, ".git")):
        print(f"error: --checkout {args.checkout} is not a git checkout", file=sys.stderr)
        return 2
    tags, commit = checkout_tags(args.checkout), checkout_commit(args.checkout)
    folders, other = select_folders(args.patches, args.upstream, tags, commit)
    patches = [x for f in folders for x in sorted(glob.glob(os.path.join(f, "*.patch")))]
    if not patches:
        if other and args.upstream is not None:
            print(f"error: the checkout is at tag(s) {', '.join(tags) or '(none)'}, commit {commit[:10]}; no "
                  f"{args.upstream} patch fits it. Patches exist for {', '.join(sorted(other))}: check out one "
                  "of those", file=sys.stderr)
            return 1
        print("no patches to check (see patches/README.md for the integration points)")
        return 0
    failed, pending = [], []
    for patch in patches:
        name = os.path.relpath(patch, args.patches)
        if is_applied(args.checkout, patch):
            print(f"ok   {name} (already applied)")
            continue
        res = _git_apply(args.checkout, patch, "--check")
        print(f"{'ok  ' if res.returncode == 0 else 'FAIL'} {name}")
        if res.returncode:
            failed.append(patch)
            print(res.stderr.strip(), file=sys.stderr)
        else:
            pending.append(patch)
    if failed:
        return 1
    if args.apply:
        for patch in pending:
            subprocess.run(["git", "apply", patch], cwd=args.checkout, check=True)
        print(f"applied {len(pending)} patch(es)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
