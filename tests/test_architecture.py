"""The package's shape, checked from its source (nothing imported but the Runner classes).

Rules (docs/ARCHITECTURE.md, "Rules the tests enforce"):
1. No private name crosses a module boundary: `from homelab_llm.x import _name` fails unless
   `_name` is itself a module. A name two modules share is public; rename it.
2. No import cycle between homelab_llm modules. Every import counts: module-level ones and the lazy
   ones inside functions alike (a lazy import hides a cycle from import time, not from the
   design). Only imports under `if TYPE_CHECKING:` are left out: they never run.
   `from pkg import name` depends on `pkg.name` when that is a module, else on `pkg/__init__.py`.
3. ModelRunner and ParallelRunner both define every member of the Runner protocol, with the same
   parameters (core.py holds either one as a Runner).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "homelab_llm"


def _modules() -> dict[str, Path]:
    root = PACKAGE.parent
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _scan() -> tuple[dict[str, set[str]], list[str]]:
    """(import graph between homelab_llm modules, private cross-module imports)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: list[str] = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                target = _absolute(module, path.name == "__init__.py", node)
                if not target.startswith("homelab_llm"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    dst = sub if sub in mods else target
                    if dst in mods and dst != module:
                        edges[module].add(dst)
                    if alias.name.startswith("_") and not alias.name.startswith("__") \
                            and sub not in mods:
                        private.append(f"{module}:{node.lineno} imports {target}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods and alias.name != module:
                        edges[module].add(alias.name)
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_private_name_crosses_a_module_boundary() -> None:
    _, private = _scan()
    assert private == [], "rename what modules share (no leading underscore):\n" + "\n".join(private)


def test_no_import_cycles() -> None:
    edges, _ = _scan()
    cycles = _cycles(edges)
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_cycles_and_private_names() -> None:
    # The checker itself: a cycle through a lazy import is found, a TYPE_CHECKING one is not.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nimport y\n")
    skipped = _type_checking_nodes(tree)
    kept = [n for n in ast.walk(tree) if isinstance(n, ast.Import) and id(n) not in skipped]
    assert [a.name for n in kept for a in n.names] == ["y"]
    edges, _ = _scan()
    assert "homelab_llm.engine.parallel.runner" in edges["homelab_llm.engine.parallel"]  # lazy


def test_both_runners_satisfy_the_runner_protocol() -> None:
    from homelab_llm.engine.parallel.runner import ParallelRunner
    from homelab_llm.engine.runner import ModelRunner
    from homelab_llm.engine.runner_protocol import Runner

    members = [n for n in vars(Runner) if not n.startswith("_")]
    assert {"forward", "prepare", "shutdown", "memory"} <= set(members)
    for cls in (ModelRunner, ParallelRunner):
        source = inspect.getsource(cls)
        for name in Runner.__annotations__:  # instance attributes, set in __init__
            assert f"self.{name} =" in source, f"{cls.__name__} never sets {name}"
        for name in members:
            want = vars(Runner)[name]
            if isinstance(want, property):  # a property or a plain attribute satisfies it
                assert hasattr(cls, name) or f"self.{name} =" in source, (cls.__name__, name)
                continue
            assert hasattr(cls, name), f"{cls.__name__} lacks Runner.{name}"
            got = inspect.signature(getattr(cls, name)).parameters
            assert list(got) == list(inspect.signature(want).parameters), (cls.__name__, name)
