"""Check (and optionally apply) the patches under ``patches/`` against an upstream checkout.

    python tools/apply_patches.py --checkout ~/src/verl [--upstream verl] [--apply]

Every ``patches/<upstream>-<version>/*.patch`` whose upstream matches is checked with
``git apply --check`` in the checkout (in name order); ``--apply`` applies them once all
check cleanly. Exit code 1 if any patch does not apply.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys

PATCHES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patches")


def find_patches(root: str, upstream: str | None):
    out = []
    for folder in sorted(glob.glob(os.path.join(root, "*-*"))):
        name = os.path.basename(folder)
        if os.path.isdir(folder) and (upstream is None or name.rsplit("-", 1)[0] == upstream):
            out += sorted(glob.glob(os.path.join(folder, "*.patch")))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", required=True, help="the upstream git checkout")
    p.add_argument("--upstream", default=None, help="only patches/<upstream>-<version>/ folders")
    p.add_argument("--patches", default=PATCHES, help="patch root (default: this repo's patches/)")
    p.add_argument("--apply", action="store_true", help="apply after every patch checked cleanly")
    args = p.parse_args(argv)
    if not os.path.isdir(os.path.join(args.checkout, ".git")):
        print(f"error: --checkout {args.checkout} is not a git checkout", file=sys.stderr)
        return 2
    patches = find_patches(args.patches, args.upstream)
    if not patches:
        print("no patches to check (see patches/README.md for the integration points)")
        return 0
    failed = []
    for patch in patches:
        res = subprocess.run(["git", "apply", "--check", patch], cwd=args.checkout, capture_output=True, text=True)
        print(f"{'ok  ' if res.returncode == 0 else 'FAIL'} {os.path.relpath(patch, args.patches)}")
        if res.returncode:
            failed.append(patch)
            print(res.stderr.strip(), file=sys.stderr)
    if failed:
        return 1
    if args.apply:
        for patch in patches:
            subprocess.run(["git", "apply", patch], cwd=args.checkout, check=True)
        print(f"applied {len(patches)} patch(es)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
