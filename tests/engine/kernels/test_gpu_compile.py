"""Every Triton kernel compiles for sm_80, sm_90 and gfx1100 with each arch's tuning-table tiles,
on a machine without a GPU (see gpu_compile.py for how launches are captured and compiled).

The CPU interpreter accepts code the real compiler rejects; this is the check that catches it.
Compiles listed as passed by their Triton cache key (compile_known.py) are not repeated; the
rest take up to ~12 minutes on two cores (more on a loaded box), so the timeouts are generous:
a slow machine is not a failed compile. In a run of the whole suite
the compiles start right after collection, in the background, and these tests run last
(compile_background.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.timeout(4400)  # above compile_background.TIMEOUT, under CI's 90 minutes

from tests.engine.kernels.compile_background import JOBS, TIMEOUT, started  # noqa: E402
from tests.engine.kernels.gpu_compile import TARGETS, launched_kernels, run_all  # noqa: E402


@pytest.fixture(scope="module")
def compile_report(request: pytest.FixtureRequest) -> dict:
    handle = started(request.config)
    if handle is not None:
        return handle.result()
    return run_all(list(TARGETS), jobs=JOBS, timeout=TIMEOUT)


def test_the_launch_scan_finds_kernels() -> None:
    # A guard on the regex: if it stopped matching, the coverage check below would pass vacuously.
    names = {k.split(":")[1] for k in launched_kernels()}
    assert len(names) >= 15 and {"_rms_norm_kernel", "_w4a16_gemv_kernel", "_one_shot_kernel"} <= names, names


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_launched_kernel_is_captured(compile_report: dict, target: str) -> None:
    missing = compile_report["missing"][target]
    assert not missing, (f"{target}: kernels launched in homelab_llm/engine/kernels but never reached by "
                         f"gpu_compile._scenarios (add a wrapper call there): {missing}")


@pytest.mark.parametrize("target", list(TARGETS))
def test_kernels_compile(compile_report: dict, target: str) -> None:
    if target in compile_report["skipped"]:
        pytest.skip(compile_report["skipped"][target])
    results = [r for r in compile_report["results"] if r["target"] == target]
    assert results, f"no kernels compiled for {target}"
    failures = [r for r in results if r["error"]]
    msg = "\n\n".join(
        f"{r['kernel']} for {target} (options {r['options']}, constexprs/ints {r['constexprs']}):\n"
        f"{r['error'][:2000]}" for r in failures)
    assert not failures, f"{len(failures)} of {len(results)} kernel compiles failed for {target}:\n\n{msg}"
