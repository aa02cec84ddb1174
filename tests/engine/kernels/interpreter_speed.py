"""Triton's CPU interpreter without its per-helper-call re-patching (test speed only).

Under TRITON_INTERPRET=1 a kernel launch patches triton.language's builtins for the launch
(`interpreter._patch_lang`: `inspect.getmembers` over tl, tl.tensor, tl.math and more) and
restores them after it. Every call of a `@triton.jit` helper from inside the kernel patches them
again and never restores that (the launch's restore undoes all of it), once per program
instance: in a decode-step test ~25,000 such calls took ~30% of the interpreter's time
(cProfile of test_norm_chain_layers' hybrid step: 90 of 289 s in `_patch_lang`, 64 launches).
While a launch runs, a helper whose module sees no triton.language module the launch did not
patch already sees interpreted builtins, so `install` skips its re-patch; everything else
(launches, helpers called outside a launch, helpers in other modules) goes through Triton's own
code. `test_interpreter_speed.py` checks results are unchanged and the skip happens.
"""

from __future__ import annotations

import sys
from typing import Any

_ACTIVE: list[frozenset[int]] = []  # per running launch: ids of the language modules it patched
_LANGS: dict[int, frozenset[int]] = {}  # id(a function's globals) -> ids of its language modules
SKIPPED = [0]  # helper calls that skipped the re-patch (for the test)


def _langs(fn: Any, modules: tuple[Any, ...]) -> frozenset[int]:
    key = id(fn.__globals__)
    found = _LANGS.get(key)
    if found is None:
        found = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in modules))
        _LANGS[key] = found
    return found


def install() -> bool:
    """Patch the interpreter in this process (idempotent). False where this Triton's interpreter
    lacks the pieces (another version): nothing is changed then."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
        grid_call = interpreter.GridExecutor.__call__
        helper_code = interpreter.InterpretedFunction.__call__.__code__
        patch_lang = interpreter._patch_lang
    except (ImportError, AttributeError):
        return False
    if getattr(patch_lang, "homelab_llm_fast", False):
        return True
    if "_patch_lang" not in helper_code.co_names:  # the helper call no longer re-patches
        return False
    modules = (tl, tl.core)

    def launch(self, *args, **kwargs):
        _ACTIVE.append(_langs(self.fn, modules))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _ACTIVE.pop()

    def fast_patch_lang(fn):
        if _ACTIVE and sys._getframe(1).f_code is helper_code and _langs(fn, modules) <= _ACTIVE[-1]:
            SKIPPED[0] += 1
            return None  # the helper call discards the scope
        return patch_lang(fn)

    fast_patch_lang.homelab_llm_fast = True  # type: ignore[attr-defined]
    interpreter.GridExecutor.__call__ = launch
    interpreter._patch_lang = fast_patch_lang
    return True
