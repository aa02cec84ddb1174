"""Regenerate the README screenshots (docs/tui-*.svg) from the app and a real engine.

    python scripts/tui_screenshot.py [--shots dashboard,bench,wizard,hardware] [--size 120x40]

Starts `homelab-llm serve` (the embedded SmolLM2 on the CPU) on a free port, streams a few chat
requests at it so the charts have data, then per shot: the dashboard watching that server after
a question typed into the chat box; the Bench screen after a real (small) depth sweep; the
build wizard's verdict; the Hardware screen on a recorded sysfs tree (this machine may have no
GPU). Saves each screen as SVG, then stops everything.
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


async def shoot_dashboard(pilot, settle_s: float) -> None:
    app = pilot.app
    chat_input = app.screen.query_one("#chat-input")
    for _ in range(240):  # the box takes the keys once the server answered a poll
        await pilot.pause(0.5)
        if app.focused is chat_input:
            break
    else:
        raise SystemExit("the chat box never got the focus (no answer from the server?)")
    await pilot.press(*"Name a fast file system.", "enter")
    chat = app.screen.query_one("#chat")
    for _ in range(240):  # the reply streams in; wait for it to finish
        await pilot.pause(0.5)
        if chat.last_timing is not None and chat.last_timing.finished_at is not None:
            break
    await pilot.pause(settle_s)
    for _ in range(120):  # a loaded CPU box can miss a poll: shoot on an answered one
        if app.snapshot.ok:
            break
        await pilot.pause(0.5)


async def shoot_bench(pilot, settle_s: float) -> None:
    app = pilot.app
    await pilot.press("escape", "b")
    screen = app.screen
    for name, value in (("pp", "64"), ("tg", "16"), ("points", "0,256,512"), ("repetitions", "1")):
        screen.query_one(f"#b-{name}").value = value
    await pilot.pause(0.2)
    await pilot.press("ctrl+r")
    for _ in range(600):
        await pilot.pause(0.5)
        if screen.job is not None and not screen.job.running:
            break
    app.set_focus(None)
    await pilot.pause(1.0)


async def shoot_wizard(pilot, settle_s: float) -> None:
    await pilot.press("escape", "h", "w")
    for _ in range(4):
        await pilot.press("ctrl+n")
    pilot.app.set_focus(None)
    await pilot.pause(1.0)


async def shoot_hardware(pilot, settle_s: float) -> None:
    await pilot.press("escape", "h")
    await pilot.pause(settle_s)


SHOTS = {"dashboard": shoot_dashboard, "bench": shoot_bench, "wizard": shoot_wizard,
         "hardware": shoot_hardware}
FILES = {"dashboard": "tui-dashboard.svg", "bench": "tui-bench.svg",
         "wizard": "tui-build-wizard.svg", "hardware": "tui-hardware.svg"}


async def shoot(url: str, shot: str, out: Path, size: tuple[int, int], settle_s: float) -> None:
    from homelab_llm.tui.app import HomelabApp
    from homelab_llm.tui.hardware import NoTelemetry, collect_hardware_report

    extra = {}
    if shot == "hardware":  # a recorded two-GPU AM5 PC: the chipset slot, the matrix, the tree
        root = str(REPO / "tests" / "hwcheck" / "fixtures" / "am5_chipset_x4")
        extra = {"hardware_source": lambda: collect_hardware_report(root),
                 "telemetry": NoTelemetry()}
    app = HomelabApp(watch_url=url, **extra)
    async with app.run_test(size=size) as pilot:
        await SHOTS[shot](pilot, settle_s)
        app.save_screenshot(filename=out.name, path=str(out.parent))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shots", default="dashboard,bench,wizard,hardware")
    p.add_argument("--out-dir", default=str(REPO / "docs"))
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
        workers = [threading.Thread(target=load, args=(url, stop), daemon=True) for _ in range(1)]
        for w in workers:
            w.start()
        time.sleep(3)
        cols, rows = (int(x) for x in a.size.split("x"))
        for shot in a.shots.split(","):
            if shot != "dashboard":
                stop.set()  # the sweep measures the server alone
            out = Path(a.out_dir) / FILES[shot]
            asyncio.run(shoot(url, shot, out, (cols, rows), a.settle))
            print(f"wrote {out}")
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
