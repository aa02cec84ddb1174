"""Instructions in each W4A16 GEMV's K loop, per packed word, from the compiler alone (no GPU).

    python3 benchmarks/ptx_counts.py [--target sm90] [--kernels w4a16_] [--sass-out DIR]

Captures the engine's launches with the tuning table forced to the target (the
tests/engine/kernels/gpu_compile.py scenarios, under TRITON_INTERPRET=1), compiles each distinct
launch whose kernel name contains --kernels, and counts the instructions of the longest loop
(a backward branch) in its PTX and in the SASS (cuobjdump, shipped with Triton). Kernels whose
constexprs name BLOCK_N and ROWS/WROWS also get per packed word (8 weights) figures: a thread
walks BLOCK_N x word rows / (32 x warps) words per iteration. This is the local evidence of
speed for a decode GEMV that dequantizes in registers (fewer issue slots per byte read); the
timing itself is benchmarks/w4a16_sweep.py's.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def loop_body(lines: list[tuple[int, str]], branch: re.Pattern, label_of) -> list[str]:
    """Instructions of the longest loop: (position, text) lines, a backward branch's target
    position from label_of(match)."""
    best: list[str] = []
    for pos, text in lines:
        m = branch.search(text)
        target = label_of(m) if m else None
        if target is not None and target < pos:
            body = [t for p, t in lines if target <= p <= pos]
            best = body if len(body) > len(best) else best
    return best


def ptx_loop(ptx: str) -> list[str]:
    raw = [line.strip() for line in ptx.splitlines()]
    labels = {line.split(":")[0]: i for i, line in enumerate(raw) if re.match(r"^\$L__\w+:", line)}
    code = [(i, t) for i, t in enumerate(raw) if t and not t.startswith(("$L", "//", ".", "{", "}"))]
    return loop_body(code, re.compile(r"bra(?:\.uni)?\s+(\$L__\w+);"), lambda m: labels.get(m.group(1)))


def sass_loop(cubin: bytes) -> list[str]:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    code = [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    return loop_body(code, re.compile(r"BRA\s+0x([0-9a-f]+)"), lambda m: int(m.group(1), 16))


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="sm90", choices=["sm80", "sm90"])
    ap.add_argument("--kernels", default="w4a16_", help="kernel names containing this")
    ap.add_argument("--sass-out", default=None,
                    help="also write each launch's loop SASS and PTX to DIR/<kernel>.<n>.sass / .ptx "
                         "(read the order of loads and math), and its whole TTGIR to .ttgir (layouts)")
    a = ap.parse_args()
    from tests.engine.kernels.gpu_compile import TARGETS, resource_usage, to_source_args

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
        subprocess.run([sys.executable, "-m", "tests.engine.kernels.gpu_compile", "_capture", a.target,
                        f"{tmp}/specs.json"], cwd=ROOT, env=env, check=True, capture_output=True)
        specs = json.loads(Path(f"{tmp}/specs.json").read_text())[a.target]
    os.environ.pop("TRITON_INTERPRET", None)
    if a.sass_out:
        Path(a.sass_out).mkdir(parents=True, exist_ok=True)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch, warp, _ = TARGETS[a.target]
    seen = set()
    for spec in specs:
        if a.kernels not in spec["kernel"]:
            continue
        mod, name = spec["kernel"].split(":")
        fn = getattr(importlib.import_module(mod), name)
        sig, consts, attrs = to_source_args(fn, spec)
        key = json.dumps([spec["kernel"], sig, consts, spec["options"]], sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                                target=GPUTarget(backend, arch, warp), options=dict(spec["options"]))
        ptx, sass = ptx_loop(kernel.asm["ptx"]), sass_loop(kernel.asm["cubin"])
        c = {k: v for k, v in consts.items() if isinstance(k, str) and k.isupper()}
        words = None
        wrows = c.get("WROWS", c.get("ROWS"))
        if "BLOCK_N" in c and wrows:
            # a whole-K tile (w4a16_h2 KSPLIT > 1) loads KSPLIT K ranges' word rows a step
            words = c["BLOCK_N"] * wrows * c.get("KSPLIT", 1) / (32 * spec["options"].get("num_warps", 4))
        per = (f"per packed word: PTX {len(ptx) / words:5.1f} SASS {len(sass) / words:5.1f} "
               f"(SASS per weight {len(sass) / words / 8:.2f})" if words else "")
        if a.sass_out:
            Path(a.sass_out, f"{name}.{len(seen)}.sass").write_text(f"{c}\n" + "\n".join(sass) + "\n")
            Path(a.sass_out, f"{name}.{len(seen)}.ptx").write_text(f"{c}\n" + "\n".join(ptx) + "\n")
            Path(a.sass_out, f"{name}.{len(seen)}.ttgir").write_text(kernel.asm["ttgir"])
        print(f"{name} {c} warps {spec['options'].get('num_warps')} {resource_usage(kernel, a.target)}\n"
              f"  loop: PTX {len(ptx)} SASS {len(sass)} {per}\n"
              f"  SASS opcodes: {dict(collections.Counter(map(opcode, sass)).most_common(10))}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
