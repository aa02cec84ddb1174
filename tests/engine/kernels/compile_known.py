"""Compiles already known to pass, by Triton's own cache key: the GPU compile check's memo.

`triton.compile` names each compile by a key over the kernel's source and every @triton.jit
function and constexpr global it reaches (`JITFunction.cache_key`), the signature, constexprs
and attributes, the parsed options, the target's backend (arch and assembler version), the
Triton install itself (`triton_key`: a hash of its sources) and its cache-invalidating
environment: what its on-disk cache trusts to return an earlier binary. KNOWN_FILE records the
keys of compiles that passed (with their shared memory, for the size check), so a run compiles
only what changed since the file was written: a kernel edit, a new tile, another Triton or
assembler each give new keys, which compile as before. With every kernel unchanged the check
costs its capture and these keys (18 s on two cores) instead of ~1,800 CPU seconds.

Rewrite the file after changing kernels (it compiles everything, then keeps the keys that passed):
    python -m tests.engine.kernels.gpu_compile --write-known
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

KNOWN_FILE = Path(__file__).with_name("gpu_compile_known.json")


def compile_key(src, target, options: dict) -> str:
    """The sha256 of Triton's cache key for compiling `src` (an ASTSource) for `target` (a
    GPUTarget) with `options`, computed as `triton.compile` does before it looks in its cache."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key

    backend = make_backend(target)
    parsed = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, parsed, env_vars=get_cache_invalidating_env_vars())
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def load_known(path: Path = KNOWN_FILE) -> dict[str, int]:
    """key -> shared memory bytes of every compile known to pass ({} without the file)."""
    if not path.exists():
        return {}
    return dict(json.loads(path.read_text())["passed"])


def write_known(results: list[dict], path: Path = KNOWN_FILE) -> int:
    """Keep the keys of the results that compiled (a full run's); returns how many."""
    passed = {r["key"]: r["shared"] for r in results if not r["error"] and r.get("key")}
    path.write_text(json.dumps({"about": "tests/engine/kernels/compile_known.py",
                                "passed": dict(sorted(passed.items()))}, indent=0) + "\n")
    return len(passed)
