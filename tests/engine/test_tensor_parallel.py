"""Tensor parallelism on the CPU (gloo): TP=N logits equal TP=1, failures stop everything cleanly,
and two local processes stand in for two nodes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from homelab_llm.engine.args import EngineArgsError
from homelab_llm.engine.llm import LLM
from homelab_llm.engine.sampling_params import SamplingParams
from tests.engine.model_reference import make_hf_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[11, 42, 7, 99, 3, 150, 8], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [77]]
# Divisible by 2 and 3, and a vocab the byte-level tokenizer fits in.
SHAPE = dict(intermediate_size=192, vocab_size=320)
REPO = Path(__file__).resolve().parents[2]


def byte_tokenizer(folder: Path) -> str:
    """The random test models ship no tokenizer.json; a config JSON gives a byte tokenizer."""
    return str(folder / "config.json")


def first_step_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of every prompt's last token from one batched prefill through the runner."""
    e = llm.engine
    for i, p in enumerate(prompts):
        e.add_request(f"probe{i}", p, SamplingParams(max_tokens=1))
    plan = e.scheduler.schedule()
    logits = e.runner.forward(e.runner.prepare(plan.scheduled)).clone()
    for i in range(len(prompts)):
        e.abort_request(f"probe{i}")
    e.step()
    return logits


def run_tp(path: Path, tp: int, **kw) -> tuple[torch.Tensor, list[list[int]]]:
    llm = LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=tp, page_size=4,
              kv_cache_memory_bytes=4 << 20, tokenizer=byte_tokenizer(path), **kw)
    try:
        logits = first_step_logits(llm, PROMPTS)
        tokens = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
        devices = llm.engine.status()["devices"]
        assert len(devices) == tp and all(d["weights"] > 0 and d["kv_cache"] > 0 for d in devices)
    finally:
        llm.shutdown()
    return logits, tokens


@pytest.mark.parametrize("kind,heads,tp", [("qwen3", (6, 2), 2), ("llama", (6, 3), 3),
                                           ("llama", (6, 3), 2)])
def test_tp_matches_single_rank(tmp_path: Path, kind: str, heads: tuple[int, int], tp: int) -> None:
    make_hf_model(kind, tmp_path, num_attention_heads=heads[0], num_key_value_heads=heads[1],
                  **SHAPE)
    ref_logits, ref_tokens = run_tp(tmp_path, 1)
    logits, tokens = run_tp(tmp_path, tp)
    # fp32 with sums split over ranks: only reduction order differs.
    assert (logits - ref_logits).abs().max() <= 1e-3 * ref_logits.abs().max()
    assert tokens == ref_tokens


@pytest.mark.slow
def test_tp2_smollm2_uneven_heads(smollm2_path: Path) -> None:
    """SmolLM2: 9 query / 3 KV heads over 2 ranks = 6+3 query, 2+1 KV heads."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [4093, 30, 216, 33, 5651]]
    outs = []
    for tp in (1, 2):
        llm = LLM(str(smollm2_path), device="cpu", dtype="float32", tensor_parallel_size=tp,
                  kv_cache_memory_bytes=64 << 20, max_model_len=256)
        try:
            outs.append((first_step_logits(llm, prompts),
                         [c.token_ids for c in llm.generate(prompts, GREEDY)]))
        finally:
            llm.shutdown()
    (l1, t1), (l2, t2) = outs
    assert (l1 - l2).abs().max() <= 1e-3 * l1.abs().max()
    assert t1 == t2


def test_invalid_size_names_the_valid_ones(tmp_path: Path) -> None:
    make_hf_model("llama", tmp_path, num_attention_heads=6, num_key_value_heads=2, **SHAPE)
    with pytest.raises(EngineArgsError, match=r"valid sizes: 1, 2, 6"):
        LLM(str(tmp_path), device="cpu", tensor_parallel_size=4, tokenizer=byte_tokenizer(tmp_path))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "drive.py"
    path.write_text(textwrap.dedent(body))
    return path


def _run(script: Path, env_extra: dict[str, str] | None = None, timeout: float = 120):
    env = {**os.environ, "PYTHONPATH": f"{script.parent}{os.pathsep}{REPO}", **(env_extra or {})}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


DRIVER = """
    import os, sys
    from homelab_llm.engine.llm import LLM
    from homelab_llm.engine.sampling_params import SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1] if len(sys.argv) > 1 else {path!r}, device="cpu", dtype="float32",
                  tensor_parallel_size=2, page_size=4, kv_cache_memory_bytes=4 << 20,
                  tokenizer={path!r} + "/config.json")
        pids = [p.pid for p in llm.engine.runner.procs]
        print("WORKERS", *pids, flush=True)
        {action}
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=40, ignore_eos=True))
        print("DONE", out[0].token_ids, flush=True)
        llm.shutdown()
"""


def test_a_killed_rank_stops_everything_with_an_error(tmp_path: Path) -> None:
    make_hf_model("llama", tmp_path, num_attention_heads=6, num_key_value_heads=2, **SHAPE)
    script = _script(tmp_path, DRIVER.format(
        path=str(tmp_path), action="import signal; os.kill(pids[0], signal.SIGKILL)"))
    proc = _run(script)
    assert proc.returncode != 0
    assert "DONE" not in proc.stdout
    assert "rank 1" in proc.stderr and "worker failed" in proc.stderr
    workers = [int(x) for x in proc.stdout.split("WORKERS", 1)[1].split("\n")[0].split()]
    deadline = time.time() + 5
    while any(_alive(p) for p in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in workers), "an orphaned rank survived"


def test_a_raising_rank_reports_its_error(tmp_path: Path) -> None:
    make_hf_model("llama", tmp_path, num_attention_heads=6, num_key_value_heads=2, **SHAPE)
    # Every process (the spawned ranks too) imports sitecustomize: rank 1 fails its 3rd forward.
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        from homelab_llm.engine import runner
        _orig, _calls = runner.ModelRunner.forward, [0]
        def forward(self, batch):
            if self.tp_rank == 1:
                _calls[0] += 1
                if _calls[0] == 3:
                    raise RuntimeError("injected failure on rank 1")
            return _orig(self, batch)
        runner.ModelRunner.forward = forward
    """))
    script = _script(tmp_path, DRIVER.format(path=str(tmp_path), action="pass"))
    proc = _run(script)
    assert proc.returncode != 0
    assert "injected failure on rank 1" in proc.stderr


def test_two_local_processes_as_two_nodes(tmp_path: Path) -> None:
    make_hf_model("llama", tmp_path, num_attention_heads=6, num_key_value_heads=2, **SHAPE)
    from homelab_llm.engine.parallel.launch import free_port

    port = free_port()
    common = (f"device='cpu', dtype='float32', tensor_parallel_size=2, page_size=4, "
              f"kv_cache_memory_bytes=4 << 20, nnodes=2, master_addr='127.0.0.1', "
              f"master_port={port}")
    node1 = _script(tmp_path, f"""
        import sys
        from homelab_llm.engine.args import EngineArgs
        from homelab_llm.engine.parallel import serve_worker_node
        if __name__ == "__main__":
            sys.exit(serve_worker_node(EngineArgs(model={str(tmp_path)!r}, node_rank=1, {common})))
    """).rename(tmp_path / "node1.py")
    node0 = _script(tmp_path, f"""
        from homelab_llm.engine.llm import LLM
        from homelab_llm.engine.sampling_params import SamplingParams
        if __name__ == "__main__":
            llm = LLM({str(tmp_path)!r}, node_rank=0, tokenizer={byte_tokenizer(tmp_path)!r}, {common})
            out = llm.generate({PROMPTS!r}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            print("TOKENS", [c.token_ids for c in out])
            llm.shutdown()
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    worker = subprocess.Popen([sys.executable, str(node1)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc = _run(node0)
        w_out, w_err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert worker.returncode == 0, w_err[-2000:]
    _, ref_tokens = run_tp(tmp_path, 1)
    assert proc.stdout.split("TOKENS", 1)[1].strip() == str(ref_tokens)


def test_a_killed_rank_makes_an_idle_engine_dead_at_once(tmp_path: Path) -> None:
    """The monitor sees the rank's process end (its sentinel): the engine is dead before any
    request arrives, says why, refuses work, and still shuts down within its bounds."""
    import signal

    from homelab_llm.engine.faults import EngineDeadError, FaultKind, classify
    from homelab_llm.engine.parallel import RankFailedError

    make_hf_model("llama", tmp_path, num_attention_heads=6, num_key_value_heads=2, **SHAPE)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", tensor_parallel_size=2, page_size=4,
              kv_cache_memory_bytes=4 << 20, tokenizer=str(tmp_path / "config.json"))
    engine = llm.engine
    try:
        assert engine.dead_reason is None
        os.kill(engine.runner.procs[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine.dead_reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.dead_reason == "rank 1 exited with code -9"
        with pytest.raises(EngineDeadError, match="rank 1 exited"):
            engine.step()
        with pytest.raises(EngineDeadError):
            engine.add_request("late", [5, 6, 7], SamplingParams(max_tokens=2))
        assert classify(RankFailedError("tensor parallelism stopped")) is FaultKind.FATAL
    finally:
        llm.shutdown()  # before the monitor's grace ends (it exits the process after 10 s)
