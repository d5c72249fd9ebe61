"""When an idle model unloads: a pure decision over each loaded model's last use, taking `now`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# A model busy with work the service does not see end (a row stream, an LLM stream) is looked at
# again this often, so its idle time counts from at most this long before its work ended.
BUSY_RECHECK_S = 1.0


@dataclass(frozen=True, slots=True)
class Activity:
    """One loaded model's use, as the idle sweep sees it."""

    name: str
    idle_unload_s: float  # 0: never
    last_used_s: float  # when its last request arrived or ended
    busy: bool  # requests in flight, or a load under way


@dataclass(frozen=True, slots=True)
class IdlePlan:
    """Models to unload now, and when the sweep should look again (None: nothing to watch)."""

    unload: tuple[str, ...]
    next_check_s: float | None


def plan_idle(models: Iterable[Activity], now_s: float) -> IdlePlan:
    """Unload each model unused for its `idle_unload_s`; never one that is busy."""
    unload: list[str] = []
    checks: list[float] = []
    for model in models:
        if model.idle_unload_s <= 0:
            continue
        if model.busy:
            checks.append(now_s + min(model.idle_unload_s, BUSY_RECHECK_S))
        elif now_s - model.last_used_s >= model.idle_unload_s:
            unload.append(model.name)
        else:
            checks.append(model.last_used_s + model.idle_unload_s)
    return IdlePlan(tuple(unload), min(checks, default=None))


def num_in_flight(servable: object) -> int:
    """Requests a servable has admitted and not answered; a lane group's are its lanes'."""
    lanes = getattr(servable, "lanes", None)
    if isinstance(lanes, dict):
        return sum(num_in_flight(lane) for lane in lanes.values())
    return int(getattr(servable, "num_admitted", 0))
