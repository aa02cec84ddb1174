"""The app's service actions: what `s` does (with its confirmations, see service_control) and,
at start, what happens to services an earlier app left running (adopt, stop or leave them).

A mixin of HomelabApp, kept apart so the app file stays about state and polling; it uses the
app's `service`, `snapshot`, `current_preset`, `watch_url` and `preset_named`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual import work
from textual.message import Message

from homelab_llm.errors import HomelabError
from homelab_llm.tui.pidfiles import ServiceRecord
from homelab_llm.tui.screens.adopt import ADOPT, STOP, AdoptScreen
from homelab_llm.tui.screens.confirm import ConfirmScreen
from homelab_llm.tui.service import ServiceState, stop_orphan
from homelab_llm.tui.service_control import Verb, decide_toggle

if TYPE_CHECKING:
    from homelab_llm.tui.app import HomelabApp

    _Base = HomelabApp
else:
    _Base = object


@dataclass
class OrphanMessage(Message):
    record: ServiceRecord


class ServiceActions(_Base):
    def action_toggle_service(self) -> None:
        status = self.service.status
        in_flight = 0
        if status.state is ServiceState.HEALTHY and self.snapshot.ok:
            in_flight = (self.snapshot.running or 0) + (self.snapshot.waiting or 0)
        decision = decide_toggle(status, self.current_preset, watch_url=self.watch_url,
                                 in_flight=in_flight)
        if decision.verb is Verb.NOTHING:
            return
        if not decision.question:
            self._act(decision.verb)
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self._act(decision.verb)

        self.push_screen(ConfirmScreen(decision.question), answered)

    def _act(self, verb: Verb) -> None:
        if verb is Verb.STOP:
            self._stop_service()
        elif verb is Verb.SWITCH:
            self._switch_service(self.current_preset)
        elif verb is Verb.START:
            self._start_service(self.current_preset)

    def _start_service(self, name: str) -> None:
        preset = self.preset_named(name)
        if preset is None:
            self.notify(f"no preset named {name!r}", severity="error")
            return
        try:
            self.service.start(preset)
        except HomelabError as err:
            self.notify(str(err), title=f"cannot start {preset.name}", severity="error", timeout=10)

    @work(thread=True, exclusive=True, group="service-stop")
    def _stop_service(self) -> None:
        self.service.stop()  # blocks up to the grace period, so never on the UI thread

    @work(thread=True, exclusive=True, group="service-stop")
    def _switch_service(self, name: str) -> None:
        self.service.stop()
        self.call_from_thread(self._start_service, name)

    @work(thread=True, exclusive=True, group="orphans")
    def find_orphans(self) -> None:
        for record in self.service.pidfiles.orphans():
            self.post_message(OrphanMessage(record))

    def on_orphan_message(self, message: OrphanMessage) -> None:
        record = message.record

        def answered(answer: str | None) -> None:
            if answer == ADOPT:
                self._adopt(record)
            elif answer == STOP:
                self._stop_orphan(record)

        self.push_screen(AdoptScreen(record), answered)

    def _adopt(self, record: ServiceRecord) -> None:
        preset = self.preset_named(record.preset)
        if preset is None:
            self.notify(f"no preset named {record.preset!r} any more; stop it instead (x)",
                        severity="error")
            return
        try:
            self.service.adopt(record, preset)
        except HomelabError as err:
            self.notify(str(err), title=f"cannot adopt {record.preset}", severity="error")
            return
        self.current_preset = record.preset

    @work(thread=True, group="orphans-stop")
    def _stop_orphan(self, record: ServiceRecord) -> None:
        code = stop_orphan(record, self.service.grace_s, self.service.pidfiles)
        self.call_from_thread(self.notify, f"stopped {record.preset} (pid {record.pid}, "
                                           f"exit code {code})")
