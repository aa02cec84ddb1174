"""The engine process (engine-core): it loads the engine and runs the step loop (step_loop.py), so
the server's interpreter only parses, tokenizes, streams and serves HTTP, and neither waits on
the other's GIL. Started by engine_process.py with multiprocessing's "spawn".

The wire is one duplex multiprocessing pipe (a socket pair: no network, nothing listens).
Server -> engine: step_loop's Add / Abort / Call objects (tickets are ints), None to stop.
Engine -> server, tuples: ("load", snapshot) while loading, then ("ready", EngineInfo) or
("failed", one line); ("out", rows) once per step with every output of the step (each row is a
RequestOutput's fields, in order; token ids only: the engine runs with detokenize off and the
server decodes, server/detokenize.py); ("settle", ticket, result, error); ("dead", reason).

Invariants: the process dies with the server (PR_SET_PDEATHSIG, plus EOF on the pipe ends the
loop); it ignores SIGINT/SIGTERM (a Ctrl-C in the terminal reaches the whole group: the server
drains and then stops us); it exits 0 after a stop, 1 after the engine died."""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection
from operator import attrgetter
from typing import Any

from homelab_llm.engine.faults import describe
from homelab_llm.engine.outputs import RequestOutput
from homelab_llm.errors import HomelabError
from homelab_llm.load_progress import LOAD
from homelab_llm.parent_watch import die_with_parent
from homelab_llm.server.grammar_prefetch import POLL_S as PREFETCH_POLL_S
from homelab_llm.server.grammar_prefetch import GrammarPrefetch
from homelab_llm.server.step_loop import Command, Engine, EngineNotReady, StepLoop

LOAD_REPORT_S = 0.25
# A file path: the step loop runs under cProfile and its stats are written there when it ends
# (benchmarks/server_overhead.py --profile-engine: where the engine process's time goes).
PROFILE_ENV = "HOMELAB_LLM_ENGINE_PROFILE"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass
class EngineInfo:
    """What the routes read from `client.engine` when the engine lives in another process."""

    tokenizer: Any
    max_model_len: int


# A tuple of the fields pickles in a fraction of the time of the dataclass (no class reference
# and no __dict__ per object): this is a per-step cost of the split. RequestOutput(*row) rebuilds it.
output_row: Callable[[RequestOutput], tuple] = attrgetter(*(f.name for f in fields(RequestOutput)))


def portable_error(err: BaseException) -> BaseException:
    """`err` if it survives pickling, else an error of the same family with the same text (the
    server maps HomelabError to 400, anything else to 500)."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return HomelabError(str(err)) if isinstance(err, HomelabError) else RuntimeError(describe(err))


class Readable:
    """Whether a connection has input, through one poll object for the connection's life
    (Connection.poll builds a selector per call, and both ends of the pipe ask every step)."""

    def __init__(self, conn: Connection) -> None:
        self.poller = select.poll()
        self.poller.register(conn.fileno(), select.POLLIN)

    def __call__(self, timeout: float = 0.0) -> bool:
        return bool(self.poller.poll(max(0.0, timeout) * 1000))  # milliseconds


class PipeHost:
    """The step loop's host over the pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()  # the load reporter also sends
        self.has_input = Readable(conn)
        self.stopping = False
        self.dead = False
        self.grammars: GrammarPrefetch | None = None  # set once the engine (its tokenizer) is up

    def serve(self, engine: Engine) -> None:
        self.grammars = GrammarPrefetch(engine.tokenizer, on_drop=lambda add: self.settle(
            add.ticket, error=EngineNotReady("the request was aborted before it started")))
        try:
            StepLoop(engine, self).run()
        finally:
            self.grammars.close()

    def send(self, message: tuple) -> None:
        self.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def send_bytes(self, data: bytes) -> None:
        with self.lock:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the server is gone: the next take() ends the loop
                self.stopping = True

    def take(self, timeout: float) -> tuple[list[Command], bool]:
        grammars = self.grammars
        items: list[Command] = []
        if grammars is not None and grammars.pending:
            timeout = min(timeout, PREFETCH_POLL_S)  # wake for a finished compile
        try:
            if self.has_input(timeout):
                while not self.stopping and self.has_input(0):
                    item = self.conn.recv()
                    if item is None:
                        self.stopping = True
                    elif grammars is None or (item := grammars.filter(item)) is not None:
                        items.append(item)
        except (EOFError, OSError):
            self.stopping = True  # the server died: nobody is left to serve
        if grammars is not None and grammars.pending:
            items.extend(grammars.ready())
        return items, self.stopping

    def emit(self, outputs: list[RequestOutput]) -> None:
        self.send(("out", [output_row(out) for out in outputs]))

    def settle(self, ticket: Any, result: Any = None, error: BaseException | None = None) -> None:
        self.send(("settle", ticket, result, None if error is None else portable_error(error)))

    def mark_dead(self, reason: str) -> list[Command]:
        self.dead = True
        self.send(("dead", reason))
        items, _ = self.take(0.0)
        return items


def report_load(host: PipeHost, done: threading.Event) -> None:
    while not done.wait(LOAD_REPORT_S):
        host.send(("load", LOAD.snapshot()))


def engine_core_main(factory: Callable[[], Engine], conn: Connection, parent: int,
                     log_level: int) -> None:
    """The engine process's entry point (a spawn target: everything it gets is pickled)."""
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    host = PipeHost(conn)
    loaded = threading.Event()
    reporter = threading.Thread(target=report_load, args=(host, loaded), name="load-report",
                                daemon=True)
    reporter.start()
    try:
        engine = factory()
    except BaseException as err:  # noqa: BLE001 - the server prints it as its one-line error
        loaded.set()
        reporter.join()
        logging.getLogger("homelab_llm.server").error("engine failed to load: %s: %s",
                                                      type(err).__name__, err)
        host.send(("failed", f"{type(err).__name__}: {err}"))
        sys.exit(1)
    loaded.set()
    reporter.join()
    engine.set_detokenize(False)  # the server decodes: text stays off this loop
    host.send(("load", LOAD.snapshot()))
    host.send(("ready", EngineInfo(engine.tokenizer, engine.max_model_len)))
    if profile_path := os.environ.get(PROFILE_ENV):
        serve_profiled(host, engine, profile_path)
    else:
        host.serve(engine)
    sys.exit(1 if host.dead else 0)


def serve_profiled(host: PipeHost, engine: Engine, path: str) -> None:
    import cProfile

    profile = cProfile.Profile()
    try:
        profile.runcall(host.serve, engine)
    finally:
        profile.dump_stats(path)
