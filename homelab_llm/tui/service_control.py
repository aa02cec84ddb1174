"""What one press of `s` means, decided from plain state so it can be tested without an app.

Rules (issue 20): `s` never abandons or replaces something silently. Stopping while requests are
in flight, starting a local preset while watching a `--url` server, and switching from the
running preset to the selected one each ask first; everything else acts at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from homelab_llm.tui.service import ServiceState, ServiceStatus


class Verb(enum.Enum):
    START = "start"
    STOP = "stop"
    SWITCH = "switch"  # stop the running preset, then start the selected one
    NOTHING = "nothing"  # stopping already under way


@dataclass(frozen=True)
class ToggleDecision:
    verb: Verb
    question: str = ""  # asked in a ConfirmScreen first when not empty


def decide_toggle(status: ServiceStatus, selected: str, *, watch_url: str | None,
                  in_flight: int) -> ToggleDecision:
    if status.state is ServiceState.STOPPING:
        return ToggleDecision(Verb.NOTHING)
    if status.running and status.preset != selected:
        return ToggleDecision(Verb.SWITCH, f"Stop {status.preset} and start {selected}?"
                              + _in_flight_note(in_flight))
    if status.running:
        if in_flight > 0:
            return ToggleDecision(Verb.STOP, f"Stop {status.preset}?" + _in_flight_note(in_flight))
        return ToggleDecision(Verb.STOP)
    if watch_url:
        return ToggleDecision(Verb.START, f"You are watching {watch_url}. Start the local preset "
                                          f"{selected} as well?")
    return ToggleDecision(Verb.START)


def _in_flight_note(in_flight: int) -> str:
    if in_flight <= 0:
        return ""
    noun = "request is" if in_flight == 1 else "requests are"
    return f" {in_flight} {noun} in flight and will fail."
