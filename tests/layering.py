"""The package's architecture rules, checked from the source (an AST walk of every import).

Layers, from the bottom; an import may point to its own layer or a lower one, never up:

    foundation   _deps _megatron cpu atomic flops peak_memory layout model distributed full_state
    data         tree losses agentic
    kernels      attention/
    slots        spec/            (what fills Megatron's slots)
    scoring      scoring/
    replay       replay/
    reference    reference/
    training     training/
    integrations integrations/
    conversion   hf/
    commands     commands/
    cli          cli

Rules (each violation is one line naming the file and line):

* no import cycle among the package's modules (module level and inside functions);
* no import upwards;
* no private name (``_x``) imported from another module of the package;
* no private attribute written on another object (``obj._x = ...``, except ``self`` /
  ``cls``) outside the shim modules (:data:`PATCHES_ALLOWED`), which patch megatron-core
  and torch internals on purpose, scoped and documented;
* an import of the package's own code inside a function only with a reason written
  beside it (a comment on the line or on the line above).
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Optional, Set, Tuple

LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("foundation", ("_deps", "_megatron", "cpu", "atomic", "flops", "peak_memory", "layout", "model",
                    "distributed", "full_state")),
    ("data", ("tree", "losses", "agentic")),
    ("kernels", ("attention",)),
    ("slots", ("spec",)),
    ("scoring", ("scoring",)),
    ("replay", ("replay",)),
    ("reference", ("reference",)),
    ("training", ("training",)),
    ("integrations", ("integrations",)),
    ("conversion", ("hf",)),
    ("commands", ("commands",)),
    ("cli", ("cli",)),
]
# Modules that may write private attributes: the scoped, documented shims of third-party
# internals (CPU execution; megatron-core's dist-checkpointing writer and optimizer load).
PATCHES_ALLOWED = {"cpu", "training.dist_ckpt_shims"}


def _modules(root: str) -> Dict[str, str]:
    pkg = os.path.basename(root.rstrip(os.sep))
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(root.rstrip(os.sep)))[:-3].replace(os.sep, ".")
                if rel.endswith(".__init__"):
                    rel = rel[: -len(".__init__")]
                out[rel] = path
    assert pkg in out, f"{root}: not a package"
    return out


def layer_of(module: str, layers=LAYERS) -> Optional[int]:
    """Index of the layer of ``pkg.first[.rest]`` (None for the package root)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    for i, (_, names) in enumerate(layers):
        if parts[1] in names:
            return i
    raise KeyError(f"{module}: in no layer; add it to tests/layering.py")


def _resolve(mods: Dict[str, str], current: str, node) -> List[Tuple[str, List[str]]]:
    """(target module, names imported from it) for one import statement, package-internal only."""
    pkg = current.split(".")[0]
    out = []
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name.split(".")[0] == pkg:
                out.append((a.name, []))
        return out
    if node.level:
        base = current.split(".")
        if not mods[current].endswith("__init__.py"):
            base = base[:-1]
        base = base[: len(base) - node.level + 1]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    if name.split(".")[0] != pkg:
        return out
    for a in node.names:
        sub = f"{name}.{a.name}"
        out.append((sub, []) if sub in mods else (name, [a.name]))
    return out


def _owner(mods: Dict[str, str], name: str) -> str:
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _function_of(node, parents) -> Optional[ast.AST]:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node
    return None


def _has_reason(lines: List[str], lineno: int) -> bool:
    """A comment on the import's line, or on the line above its block of imports."""
    if "#" in lines[lineno - 1]:
        return True
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith(("from ", "import ")):
        i -= 1
    return i >= 0 and lines[i].strip().startswith("#")


def check_package(root: str, layers=LAYERS) -> List[str]:
    """Every violation of the rules above in the package at ``root``, one line each."""
    mods = _modules(root)
    problems: List[str] = []
    edges: Dict[str, Set[str]] = {m: set() for m in mods}
    where: Dict[Tuple[str, str], str] = {}
    for mod, path in sorted(mods.items()):
        text = open(path, encoding="utf-8").read()
        lines = text.split("\n")
        tree = ast.parse(text, path)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        short = mod.split(".", 1)[-1] if "." in mod else mod
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, names in _resolve(mods, mod, node):
                    target = _owner(mods, target)
                    if target == mod:
                        continue
                    loc = f"{os.path.relpath(path, os.path.dirname(root))}:{node.lineno}"
                    edges[mod].add(target)
                    where.setdefault((mod, target), loc)
                    src_layer, dst_layer = layer_of(mod, layers), layer_of(target, layers)
                    if src_layer is not None and dst_layer is not None and dst_layer > src_layer:
                        problems.append(f"{loc}: {mod} ({layers[src_layer][0]}) imports {target} "
                                        f"({layers[dst_layer][0]}), a higher layer")
                    for n in names:
                        if n.startswith("_") and not n.startswith("__"):
                            problems.append(f"{loc}: {mod} imports the private name {n} from {target}")
                    if _function_of(node, parents) is not None and not _has_reason(lines, node.lineno):
                        problems.append(f"{loc}: {mod} imports {target} inside a function without a reason "
                                        "written beside it (a comment)")
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                            and sub.attr.startswith("_") and not sub.attr.startswith("__")
                            and not (isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"))
                            and short not in PATCHES_ALLOWED):
                        problems.append(f"{os.path.relpath(path, os.path.dirname(root))}:{sub.lineno}: {mod} "
                                        f"writes the private attribute {sub.attr} of another object")
    for cycle in _cycles(edges):
        ring = " -> ".join(cycle + [cycle[0]])
        problems.append(f"{where.get((cycle[0], cycle[1 % len(cycle)]), cycle[0])}: import cycle {ring}")
    return problems


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(_ring(sorted(comp), edges))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _ring(comp: List[str], edges: Dict[str, Set[str]]) -> List[str]:
    """A cycle through the component's first module (breadth-first back to it)."""
    members = set(comp)
    start = comp[0]
    prev = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v] & members):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path))
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


def stats(root: str) -> Dict[str, int]:
    """Counts for the notes: top-level modules, cycles, private imports, function-level imports."""
    mods = _modules(root)
    pkg = os.path.basename(root.rstrip(os.sep))
    top = [m for m, p in mods.items() if m.count(".") == 1 and not p.endswith("__init__.py")]
    problems = check_package(root)
    return {
        "modules": len(mods),
        "top_level_modules": len(top),
        "cycles": sum("import cycle" in p for p in problems),
        "private_imports": sum("private name" in p for p in problems),
        "function_level_internal_imports": _count_function_imports(mods, pkg),
    }


def _count_function_imports(mods: Dict[str, str], pkg: str) -> int:
    count = 0
    for mod, path in mods.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and _function_of(node, parents) is not None:
                count += sum(1 for _ in _resolve(mods, mod, node))
    return count
