"""Regenerate docs/tui-dashboard.svg from the app watching a real engine.

    python scripts/tui_screenshot.py [--out docs/tui-dashboard.svg] [--size 120x40]

Starts `homelab-llm serve` (the embedded SmolLM2 on the CPU) on a free port, streams a few chat
requests at it so the charts have data, opens the app on the dashboard watching that server,
waits for several polls, saves the screen as SVG, then stops everything.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server at {url} not healthy after {timeout} s")


def load(url: str, stop: threading.Event) -> None:
    prompts = ["Write a haiku about GPUs.", "What is PCIe bifurcation?",
               "Explain a KV cache in two sentences.", "Name three Linux file systems."]
    i = 0
    while not stop.is_set():
        body = {"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 48, "stream": False,
                "messages": [{"role": "user", "content": prompts[i % len(prompts)]}]}
        try:
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        except httpx.HTTPError:
            pass
        i += 1


async def shoot(url: str, out: Path, size: tuple[int, int], settle_s: float) -> None:
    from homelab_llm.tui.app import HomelabApp

    app = HomelabApp(watch_url=url)
    async with app.run_test(size=size) as pilot:
        await pilot.pause(settle_s)
        app.save_screenshot(filename=out.name, path=str(out.parent))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(REPO / "docs" / "tui-dashboard.svg"))
    p.add_argument("--size", default="120x40")
    p.add_argument("--settle", type=float, default=12.0, help="seconds of polling before the shot")
    a = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "homelab_llm", "serve", "--port", str(port),
                               "--device", "cpu", "--max-model-len", "2048", "--max-num-seqs", "4"],
                              cwd=REPO, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop = threading.Event()
    try:
        wait_healthy(url)
        workers = [threading.Thread(target=load, args=(url, stop), daemon=True) for _ in range(2)]
        for w in workers:
            w.start()
        time.sleep(3)
        cols, rows = (int(x) for x in a.size.split("x"))
        asyncio.run(shoot(url, Path(a.out), (cols, rows), a.settle))
        print(f"wrote {a.out}")
    finally:
        stop.set()
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
