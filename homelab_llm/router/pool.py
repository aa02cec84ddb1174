"""The router's presets at run time: start on demand, one start shared by every waiter, count
requests in flight, unload after `ttl` idle seconds, swap presets that cannot share the GPUs.

Each preset gets its own ServiceManager (tui/service.py: process group, health wait, crash
report) on a port the router picks, so presets that all say `port = 8000` run side by side and
the router's own port stays free. Methods are coroutines on the router's event loop; the
managers' blocking calls (stop waits out a grace period) run in worker threads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from homelab_llm.errors import HomelabError
from homelab_llm.presets import Preset
from homelab_llm.router.budget import Running, claim_bytes, evictions
from homelab_llm.tui.process_group import free_port
from homelab_llm.tui.service import ServiceManager, ServiceState

POLL_S = 0.05
SWAP_WAIT_S = 600.0  # how long a request waits for busy presets to finish before a 503


def upstream_auth(preset: Preset) -> dict[str, str]:
    """A preset started with an API key (ours and vLLM spell it api_key) is called with it."""
    key = preset.args.get("api_key")
    return {"Authorization": f"Bearer {key}"} if isinstance(key, str) and key else {}


class StartError(HomelabError):
    """A preset that cannot be started or never became healthy; names the preset and why."""


@dataclass
class Slot:
    preset: Preset
    manager: ServiceManager
    claim_bytes: int
    in_flight: int = 0
    last_used: float = 0.0
    upstream_model: str = ""  # the id the server answers to (its /v1/models), for rewriting
    starting: asyncio.Task[str] | None = field(default=None, repr=False)

    @property
    def state(self) -> ServiceState:
        return self.manager.status.state

    @property
    def url(self) -> str:
        return self.manager.status.url


class Pool:
    def __init__(self, presets: list[Preset], *, ttl_s: float = 300.0, gpu_memory: int = 0,
                 gpu_budget: int | None = None, clock: Callable[[], float] = time.monotonic,
                 manager_factory: Callable[[], ServiceManager] | None = None) -> None:
        self.ttl_s = ttl_s
        self.gpu_budget = gpu_budget
        self.clock = clock
        make = manager_factory or (lambda: ServiceManager(grace_s=10.0, health_interval_s=0.1))
        self.slots = {p.name: Slot(p, make(), claim_bytes(p, gpu_memory) if gpu_memory else 0)
                      for p in presets if p.routable}
        self.swap_lock = asyncio.Lock()  # one start decision at a time: budgets add up right

    # ---------------------------------------------------------------- use

    async def acquire(self, name: str) -> Slot:
        """The slot, healthy, with one more request in flight (pair with release)."""
        slot = self.slots[name]
        slot.in_flight += 1
        slot.last_used = self.clock()
        try:
            if slot.state is not ServiceState.HEALTHY:
                if slot.starting is None or slot.starting.done():
                    slot.starting = asyncio.create_task(self._start(slot))
                await asyncio.shield(slot.starting)
        except BaseException:
            self.release(slot)
            raise
        return slot

    def release(self, slot: Slot) -> None:
        slot.in_flight -= 1
        slot.last_used = self.clock()

    # ---------------------------------------------------------------- start / stop

    async def _start(self, slot: Slot) -> str:
        while slot.state is ServiceState.STOPPING:  # a ttl unload in progress: let it finish
            await asyncio.sleep(POLL_S)
        async with self.swap_lock:
            await self._make_room(slot)
            port = free_port(slot.preset.host if ":" not in slot.preset.host else "127.0.0.1")
            try:
                slot.manager.start(slot.preset, port)
            except HomelabError as err:
                raise StartError(f"preset {slot.preset.name!r} could not start: {err}") from None
        while slot.state is ServiceState.STARTING:
            await asyncio.sleep(POLL_S)
        status = slot.manager.status
        if status.state is not ServiceState.HEALTHY:
            last = next((line for line in reversed(status.last_lines) if line.strip()), "")
            why = status.message + (f": {last.strip()}" if last else "")
            raise StartError(f"preset {slot.preset.name!r} failed to start ({why})")
        slot.upstream_model = await self._served_model(slot)
        return slot.url

    async def _served_model(self, slot: Slot) -> str:
        """The first id in the server's /v1/models (all our backends list what they serve)."""
        try:
            async with httpx.AsyncClient(timeout=10.0, headers=upstream_auth(slot.preset)) as client:
                data = (await client.get(slot.url + "/v1/models")).json().get("data") or []
            return str(data[0]["id"]) if data else ""
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return ""  # the request goes through with the model name it had

    def _running(self) -> list[Running]:
        return [Running(s.preset.name, s.claim_bytes, s.last_used, s.in_flight > 0)
                for s in self.slots.values() if s.manager.status.running]

    async def _make_room(self, slot: Slot) -> None:
        deadline = self.clock() + SWAP_WAIT_S
        while True:
            others = [r for r in self._running() if r.name != slot.preset.name]
            names = evictions(others, slot.claim_bytes, self.gpu_budget)
            if names is not None:
                await asyncio.gather(*(self.stop(n) for n in names))
                return
            if self.clock() > deadline:
                raise StartError(f"preset {slot.preset.name!r} does not fit beside the presets "
                                 "busy on the GPUs; retry when they finish")
            await asyncio.sleep(POLL_S * 4)

    async def stop(self, name: str) -> None:
        await asyncio.to_thread(self.slots[name].manager.stop)

    async def unload_idle(self) -> list[str]:
        """Stop every healthy preset idle for its ttl (0: never); returns their names."""
        now = self.clock()
        idle = [s.preset.name for s in self.slots.values()
                if s.state is ServiceState.HEALTHY and s.in_flight == 0
                and 0 < (s.preset.ttl or self.ttl_s) <= now - s.last_used]
        await asyncio.gather(*(self.stop(n) for n in idle))
        return idle

    async def unload_loop(self, every_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            await self.unload_idle()

    async def shutdown(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(s.manager.shutdown) for s in self.slots.values()))
