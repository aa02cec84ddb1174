"""compile_known: the GPU compile check skips compiles whose Triton cache key is listed as passed
and compiles the rest; the keys are the same from run to run (each compile also checks its key
against the one Triton's cache gave the binary: gpu_compile.compile_one)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from tests.engine.kernels.compile_known import KNOWN_FILE, load_known, write_known  # noqa: E402
from tests.engine.kernels.gpu_compile import run_all  # noqa: E402

KERNEL = "_qk_norm_kernel"  # three launches a target, quick compiles


def test_listed_compiles_are_skipped_and_the_rest_compile(tmp_path) -> None:
    """One compile left off the list compiles again; the listed ones are not compiled, and the
    size check still applies to them (one listed with more shared memory than sm_90 has fails)."""
    known, specs = tmp_path / "known.json", tmp_path / "specs.json"  # one capture for both runs
    first = run_all(["sm90"], jobs=1, timeout=900, only=KERNEL, known_file=known, specs_file=specs)  # no file yet
    if "sm90" in first["skipped"]:
        pytest.skip(first["skipped"]["sm90"])
    results = first["results"]
    assert len(results) >= 2 and not any(r["known"] or r["error"] for r in results), results
    assert write_known(results[1:], known) == len(results) - 1
    data = json.loads(known.read_text())
    data["passed"][results[1]["key"]] = 10 ** 7
    known.write_text(json.dumps(data))
    second = run_all(["sm90"], jobs=1, timeout=900, only=KERNEL, known_file=known, specs_file=specs)["results"]
    assert [r["key"] for r in second if not r["known"]] == [results[0]["key"]]  # compiled again
    listed = {r["key"]: r for r in second if r["known"]}
    assert set(listed) == {r["key"] for r in results[1:]}
    assert "OutOfResources" in listed[results[1]["key"]]["error"]
    assert all(listed[r["key"]]["shared"] == r["shared"] and listed[r["key"]]["error"] is None
               for r in results[2:])


def test_the_committed_file_reads() -> None:
    assert KNOWN_FILE.exists(), "run: python -m tests.engine.kernels.gpu_compile --write-known"
    assert all(len(k) == 64 and isinstance(v, int) for k, v in load_known().items())
