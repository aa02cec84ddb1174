"""`python -m tests.server.serve_fake PORT DRAIN_S STEP_DELAY_S [thread|process] [stuck]`: the real `serve`
launcher (signals, drain, exit status) over the fake engine, for the shutdown tests to run as a
child process; the engine runs in a thread of it (default) or in its own process; "stuck" adds
a non-daemon thread that never ends."""

from __future__ import annotations

import functools
import sys
import threading

from homelab_llm.server.app import build_app
from homelab_llm.server.launch import serve
from homelab_llm.server.state import ServerConfig
from tests.server.fake_engine import FakeEngine


def main() -> int:
    port, drain_s, step_delay = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else "thread"
    if "stuck" in sys.argv[5:]:  # a non-daemon thread that never ends: the interpreter's teardown waits on it
        threading.Thread(target=threading.Event().wait, name="stuck", daemon=False).start()
    app = build_app(ServerConfig(("fake",), drain_timeout_s=drain_s),
                    functools.partial(FakeEngine, step_delay=step_delay),
                    engine_process=mode == "process")
    return serve(app, "127.0.0.1", port, log_level="warning")


if __name__ == "__main__":
    sys.exit(main())
