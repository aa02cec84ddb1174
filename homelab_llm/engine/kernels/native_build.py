"""Build a C source of this package into a shared library once, and load it (ctypes).

The library lands in the user's cache (platformdirs; HOMELAB_LLM_NATIVE_CACHE overrides), named
by a hash of the source (and the headers it includes), the flags and the compiler's version,
so an edited source or another compiler builds anew and processes that start together
(tensor-parallel ranks, test workers) never load a half-written file: each compiles to its own
temporary name and renames it into place. A C compiler is optional: without one (or when it
fails) `load` returns None with the reason in `last_error`, and the callers keep their torch
paths.

OpenMP: libraries built with -fopenmp need libgomp.so.1, which torch has already loaded from its
own lib folder (torch's CPU wheel); the dynamic loader reuses that copy for the same soname, so
our parallel regions run on torch's thread team and follow torch.set_num_threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

BUILD_TIMEOUT_S = 120
_ERRORS: dict[str, str] = {}
_LOADED: dict[tuple, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    env = os.environ.get("HOMELAB_LLM_NATIVE_CACHE")
    if env:
        return Path(env)
    import platformdirs

    return platformdirs.user_cache_path("homelab-llm") / "native"


def compiler() -> str | None:
    """The C compiler: $CC, else cc / gcc / clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.splitlines()[0] if out.stdout else ""


def last_error(source: Path) -> str | None:
    """Why the last `load` of this source returned None (None if it did not)."""
    return _ERRORS.get(str(source))


def load(source: Path, flags: tuple[str, ...], headers: tuple[Path, ...] = ()) -> ctypes.CDLL | None:
    """The library built from `source` with `flags` (built on first use, then cached on disk and
    in this process), or None when it cannot be built here (see last_error). headers: the files
    it includes, hashed into its name with it."""
    key = (str(source), flags)
    if key not in _LOADED:
        _LOADED[key] = _build_and_load(source, flags, headers)
    return _LOADED[key]


def _build_and_load(source: Path, flags: tuple[str, ...], headers: tuple[Path, ...]) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        _ERRORS[str(source)] = "no C compiler (cc, gcc or clang) on PATH"
        return None
    text = source.read_bytes() + b"".join(h.read_bytes() for h in headers)
    digest = hashlib.sha256(text + repr(flags).encode() + _version(cc).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{digest}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            cmd = [cc, *flags, "-shared", "-fPIC", str(source), "-o", tmp]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if out.returncode != 0:
                os.unlink(tmp)
                lines = (out.stderr or out.stdout).strip().splitlines()
                _ERRORS[str(source)] = f"{' '.join(cmd[:2])} ... failed: " + \
                    (lines[0] if lines else f"exit {out.returncode}")
                return None
            os.replace(tmp, target)
        except (OSError, subprocess.SubprocessError) as exc:
            _ERRORS[str(source)] = f"building {source.name} failed: {exc}"
            return None
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        _ERRORS[str(source)] = f"loading {target} failed: {exc}"
        return None
