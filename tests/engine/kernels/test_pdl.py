"""Programmatic dependent launch (kernels/pdl.py): who takes it, and that no kernel taking it can
read or write ahead of the grid it follows.

CPU: the switch (off on the CPU and in the interpreter whatever the environment says, a bad
value is an error) and a source check of every kernel launched with `pdl_args`: its PDL
constexpr exists, and its `pdl_enter` is a top-level statement of the kernel body with no
store, atomic or return before it (a program that returned before waiting would let its grid
complete ahead of the one it follows, and the next grid's wait would no longer cover that one).

GPU (sm_90+): chains of PDL kernels, each reading the one before, captured in a CUDA graph and
run eagerly, equal bit for bit to the same chain launched without PDL. A consumer that read its
input before the producer had finished would read the previous replay's values or garbage.
"""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest
import torch

from homelab_llm.engine.kernels import pdl
from tests.engine.kernels.gpu_compile import launch_sites

KERNELS = Path(pdl.__file__).resolve().parent


def test_off_on_cpu_whatever_the_environment(monkeypatch) -> None:
    for value in ("", "0", "1"):
        monkeypatch.setenv(pdl.ENV, value)
        assert pdl.pdl_args(torch.device("cpu")) == {}
        assert pdl.pdl_mode(torch.device("cpu")) == pdl.OFF


def test_bad_switch_value_is_an_error(monkeypatch) -> None:
    monkeypatch.setenv(pdl.ENV, "yes")
    with pytest.raises(ValueError, match="HOMELAB_LLM_PDL"):
        pdl.pdl_mode(torch.device("cpu"))


def test_families_launched_plainly_by_the_table_or_the_switch(monkeypatch) -> None:
    cpu = torch.device("cpu")
    early = {"PDL": pdl.LATE, "launch_pdl": True}
    plain = {"PDL": pdl.LATE, "launch_pdl": False}  # still compiled to let the next grid launch
    monkeypatch.setattr(pdl, "pdl_mode", lambda device: pdl.LATE)  # as on an sm_90 device
    monkeypatch.setattr(pdl, "tiles_for", lambda device: types.SimpleNamespace(pdl_plain=("h2",)))
    monkeypatch.delenv(pdl.PLAIN_ENV, raising=False)
    assert pdl.pdl_args(cpu, "h2") == plain and pdl.pdl_args(cpu, "dot") == early
    monkeypatch.setenv(pdl.PLAIN_ENV, "dot,rest")
    assert pdl.pdl_args(cpu, "h2") == early
    assert pdl.pdl_args(cpu) == plain and pdl.pdl_args(cpu, "dot") == plain
    monkeypatch.setenv(pdl.PLAIN_ENV, "")  # set and empty: every family launches early
    assert pdl.pdl_args(cpu, "h2") == early and pdl.pdl_args(cpu, "dense") == early
    monkeypatch.setattr(pdl, "pdl_mode", lambda device: pdl.OFF)
    assert pdl.pdl_args(cpu, "h2") == {}
    monkeypatch.setenv(pdl.PLAIN_ENV, "gemv")
    monkeypatch.setattr(pdl, "pdl_mode", lambda device: pdl.EARLY)
    with pytest.raises(ValueError, match="families are"):
        pdl.pdl_args(cpu, "h2")


def test_an_experts_layers_attention_gemvs_take_their_own_family(monkeypatch) -> None:
    """Inside in_experts_layer the 1-2 row W4A16 GEMVs ("h2", "h2_wide") launch as family
    "h2_experts_layer" (early unless named plain); other families and calls outside keep theirs,
    and the scope ends with the call, also when it raises."""
    cpu = torch.device("cpu")
    early = {"PDL": pdl.EARLY, "launch_pdl": True}
    plain = {"PDL": pdl.EARLY, "launch_pdl": False}
    monkeypatch.setattr(pdl, "pdl_mode", lambda device: pdl.EARLY)
    monkeypatch.setattr(pdl, "tiles_for", lambda device: types.SimpleNamespace(
        pdl_plain=("h2", "h2_wide", "dot")))
    monkeypatch.delenv(pdl.PLAIN_ENV, raising=False)
    inside = pdl.in_experts_layer(lambda *fams: [pdl.pdl_args(cpu, f) for f in fams], "h2", "h2_wide", "dot")
    assert inside == [early, early, plain]
    assert pdl.pdl_args(cpu, "h2") == plain and pdl.pdl_args(cpu, "h2_wide") == plain

    def boom() -> None:
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError):
        pdl.in_experts_layer(boom)
    assert pdl.pdl_args(cpu, "h2") == plain
    monkeypatch.setenv(pdl.PLAIN_ENV, "h2,h2_experts_layer")
    assert pdl.in_experts_layer(pdl.pdl_args, cpu, "h2") == plain


def _pdl_launched() -> dict[str, set[str]]:
    """{module path: names of the kernels it launches with **pdl_args(...)}."""
    found: dict[str, set[str]] = {}
    for path in sorted(KERNELS.glob("*.py")):
        text = path.read_text()
        for name, call in launch_sites(text):
            # w4a16_dot and moe_decode build the options apart (**meta, **pdl)
            if "pdl_args(" in call or ("pdl_args(" in text and re.search(r"\*\*(meta|pdl)\b", call)):
                found.setdefault(str(path), set()).add(name)
    return found


def _unsafe(node: ast.AST) -> str | None:
    """What in a statement before the wait would touch another kernel's memory or end the program."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Return):
            return "return"
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "tl" \
                and (sub.attr == "store" or sub.attr.startswith("atomic")):
            return f"tl.{sub.attr}"
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) \
                and sub.func.id in ("prep_x_pairs", "store_or_reduce", "row_rstd"):
            return sub.func.id
    return None


def test_every_pdl_kernel_waits_before_touching_memory() -> None:
    launched = _pdl_launched()
    names = {n for v in launched.values() for n in v}
    # the decode step's kernels (GEMVs, attention, KV store, norms, sampling, MoE and GDN decode)
    assert {"w4a16_h2_kernel", "_w4a16_dot_kernel", "_dense_gemv_kernel", "_decode_split_kernel",
            "_rope_store_kv_kernel", "_rms_norm_kernel", "_moe_decode_up_kernel",
            "_moe_decode_down_kernel", "_moe_w4_gemv_kernel", "route_gate_kernel",
            "_recurrent_step_kernel", "_conv_decode_kernel", "_stats_kernel"} <= names, names
    for path, kernels in launched.items():
        tree = ast.parse(Path(path).read_text())
        funcs = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
        for name in kernels:
            fn = funcs[name]
            params = [a.arg for a in fn.args.args]
            assert "PDL" in params, f"{name} is launched with PDL but has no PDL constexpr"
            body = [s for s in fn.body if not (isinstance(s, ast.Expr)
                                                and isinstance(s.value, ast.Constant))]
            at = [i for i, s in enumerate(body) if isinstance(s, ast.Expr)
                  and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Name)
                  and s.value.func.id == "pdl_enter"]
            assert len(at) == 1, f"{name}: one top-level pdl_enter(PDL), found {len(at)}"
            for stmt in body[:at[0]]:
                bad = _unsafe(stmt)
                assert bad is None, f"{name}: {bad} before pdl_enter (line {stmt.lineno})"


def _chain(steps: int, dim: int, device: torch.device):
    """A closure running `steps` layers of norm-fused W4A16 GEMV, dense GEMV, RMSNorm and
    SiLU-and-mul, each reading the last one's output, and its input buffer."""
    from homelab_llm.engine.kernels import w4a16_pack as wp
    from homelab_llm.engine.kernels.dense_gemv import dense_gemv
    from homelab_llm.engine.kernels.elementwise import rms_norm, silu_and_mul
    from homelab_llm.engine.kernels.w4a16_h2 import w4a16_h2

    gen = torch.Generator().manual_seed(7)
    w4 = wp.quantize_rtn(torch.randn(dim, dim, generator=gen) * 0.05, 128, False).to(device)
    dense = (torch.randn(2 * dim, dim, generator=gen) * 0.05).to(device, torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(dim, generator=gen)).to(device, torch.bfloat16)
    x = torch.randn(1, dim, generator=gen).to(device, torch.bfloat16)

    def run() -> torch.Tensor:
        h = x
        for _ in range(steps):
            h = w4a16_h2(h, w4, torch.empty((1, dim), dtype=torch.bfloat16, device=device),
                         norm_weight=nw, eps=1e-6)
            h, _ = dense_gemv(h, dense)
            h = silu_and_mul(rms_norm(h, torch.ones(2 * dim, dtype=torch.bfloat16,
                                                    device=device), 1e-6))
        return h
    return run, x


@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None
                    or torch.cuda.get_device_capability() < (9, 0), reason="PDL needs sm_90+")
def test_pdl_chain_equals_plain_launches(monkeypatch) -> None:
    device = torch.device("cuda")
    results = {}
    for value in ("0", "1"):
        monkeypatch.setenv(pdl.ENV, value)
        assert bool(pdl.pdl_args(device)) == (value == "1")
        run, x = _chain(24, 4096, device)
        eager = run().clone()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            run()  # compile and warm the allocator outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        replays = []
        for i in range(5):
            x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(i)).to(x))
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        results[value] = (eager, replays)
    assert torch.equal(results["0"][0], results["1"][0])
    for plain, chained in zip(results["0"][1], results["1"][1]):
        assert torch.isfinite(plain.float()).all()
        assert torch.equal(plain, chained)
