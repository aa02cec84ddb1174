"""Run tests/engine/kernels without pytest (GPU boxes that lack it).

    python benchmarks/kernels_selftest.py [-k substring[,substring...]] [--part K/N]

Installs a small stand-in for the parts of pytest these tests use (parametrize, fixtures by name,
raises, skip/importorskip), then calls every test function with every parameter combination.
With pytest available, `python -m pytest tests/engine/kernels` does the same.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import os
import re
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "engine" / "kernels"


# CI's compile check for sm_80/sm_90/gfx1100 without a GPU (tens of minutes of compiles): not a
# GPU test, and longer than a device call
CPU_ONLY = {"test_gpu_compile.py"}


class Skipped(Exception):
    pass


def _shim() -> types.ModuleType:
    mod = types.ModuleType("pytest")

    class _Mark:
        def parametrize(self, names, values, ids=None):  # ids only name the cases in pytest
            def deco(fn):
                fn.__dict__.setdefault("_params", []).insert(0, ([n.strip() for n in names.split(",")], values))
                return fn
            return deco

        def skipif(self, cond, reason=""):
            def deco(fn):
                if cond:
                    fn._skip = reason
                return fn
            return deco

        def __getattr__(self, name):  # slow, gpu, ...: plain labels
            return lambda fn=None, *a, **k: fn if callable(fn) else (lambda f: f)

    @contextlib.contextmanager
    def raises(exc, match=None):
        try:
            yield
        except exc as err:
            if match and not re.search(match, str(err)):
                raise AssertionError(f"{err!r} does not match {match!r}") from err
        else:
            raise AssertionError(f"did not raise {exc}")

    def skip(reason=""):
        raise Skipped(reason)

    def importorskip(name):
        try:
            return importlib.import_module(name)  # the submodule itself, as pytest returns
        except ImportError:
            raise Skipped(f"no {name}") from None

    mod.mark = _Mark()
    mod.raises, mod.skip, mod.importorskip = raises, skip, importorskip
    mod.fixture = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    return mod


class MonkeyPatch:
    """pytest's monkeypatch fixture, the parts the kernel tests use: setattr/setitem/setenv/delenv
    and context(), undone after."""

    def __init__(self) -> None:
        self._undo: list = []

    def setattr(self, target, name: str, value) -> None:
        old = getattr(target, name)
        self._undo.append(lambda: setattr(target, name, old))
        setattr(target, name, value)

    def setitem(self, mapping, key, value) -> None:
        missing = object()
        old = mapping.get(key, missing)
        self._undo.append(lambda: mapping.pop(key, None) if old is missing else mapping.__setitem__(key, old))
        mapping[key] = value

    def setenv(self, name: str, value: str) -> None:
        self._keep_env(name)
        os.environ[name] = value

    def delenv(self, name: str, raising: bool = True) -> None:
        if raising and name not in os.environ:
            raise KeyError(name)
        self._keep_env(name)
        os.environ.pop(name, None)

    def _keep_env(self, name: str) -> None:
        old = os.environ.get(name)
        self._undo.append(lambda: os.environ.pop(name, None) if old is None else os.environ.__setitem__(name, old))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    @contextlib.contextmanager
    def context(self):
        """A MonkeyPatch whose changes are undone when the block ends (pytest's context())."""
        inner = MonkeyPatch()
        try:
            yield inner
        finally:
            inner.undo()


def _load(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("-k", default="", help="run the tests whose id contains one of these "
                        "comma-separated substrings")
    parser.add_argument("--part", default="1/1", help="K/N: only the K-th of N slices of the test files "
                        "(the whole suite outlasts one 600 s device call)")
    args = parser.parse_args()
    part, parts = (int(v) for v in args.part.split("/"))
    keys = [key for key in args.k.split(",") if key]
    sys.path.insert(0, str(ROOT))
    sys.modules["pytest"] = _shim()  # also where pytest exists: the shim records the parameters
    conftest = _load(TESTS / "conftest.py")
    fixtures = {name: getattr(conftest, name) for name in ("device", "full_shapes", "paged_kv", "attention_case")}
    fixtures["monkeypatch"] = MonkeyPatch
    passed = failed = skipped = 0
    for i, path in enumerate(sorted(TESTS.glob("test_*.py"))):
        if i % parts != part - 1 or path.name in CPU_ONLY:
            continue
        module = _load(path)
        module_fixtures: dict = {}  # a test module's own fixtures, built once (scope="module")
        module_mark = getattr(module, "pytestmark", None)  # e.g. a module-wide skipif
        for name, fn in list(vars(module).items()):
            if not name.startswith("test_") or not callable(fn):
                continue
            if callable(module_mark):
                fn = module_mark(fn)
            params = getattr(fn, "_params", [])
            combos = itertools.product(*[[dict(zip(names, v if len(names) > 1 else (v,))) for v in values]
                                         for names, values in params]) if params else [()]
            for combo in combos:
                kwargs = {k: v for part in combo for k, v in part.items()}
                test_id = f"{path.name}::{name}[{','.join(str(v) for v in kwargs.values())}]"
                if keys and not any(key in test_id for key in keys):
                    continue
                if getattr(fn, "_skip", None):
                    skipped += 1
                    continue
                needed = fn.__code__.co_varnames[: fn.__code__.co_argcount]
                start = time.perf_counter()
                try:
                    for arg in needed:
                        if arg in kwargs:
                            continue
                        if arg in fixtures:
                            kwargs[arg] = fixtures[arg]()
                        else:
                            if arg not in module_fixtures:
                                module_fixtures[arg] = getattr(module, arg)()
                            kwargs[arg] = module_fixtures[arg]
                    fn(**kwargs)
                    passed += 1
                    print(f"PASS {test_id} ({time.perf_counter() - start:.2f}s)", flush=True)
                except Skipped as why:
                    skipped += 1
                    print(f"SKIP {test_id}: {why}", flush=True)
                except Exception:
                    failed += 1
                    print(f"FAIL {test_id}\n{traceback.format_exc()}", flush=True)
                finally:
                    if isinstance(kwargs.get("monkeypatch"), MonkeyPatch):
                        kwargs["monkeypatch"].undo()
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
