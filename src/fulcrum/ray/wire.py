"""A `RequestContext` crossing to another process: its deadline and arrival are absolute
`time.monotonic()` values, which mean nothing on another machine, so they travel as durations
(time left, age) and are made absolute again on the replica's own clock."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fulcrum.context import RequestContext


@dataclass(frozen=True, slots=True)
class WireContext:
    """A context with its clock values as durations measured when it was sent."""

    ctx: RequestContext  # deadline_s and received_s cleared
    remaining_s: float | None  # None: no deadline; may be <= 0 (already late)
    age_s: float | None  # None: an internal call with no arrival time


def to_wire(ctx: RequestContext, now_s: float) -> WireContext:
    """`ctx` as sent at `now_s` (this process's time.monotonic())."""
    remaining_s = None if ctx.deadline_s is None else ctx.deadline_s - now_s
    age_s = None if ctx.received_s is None else max(0.0, now_s - ctx.received_s)
    bare = dataclasses.replace(ctx, deadline_s=None, received_s=None)
    return WireContext(bare, remaining_s, age_s)


def from_wire(wire: WireContext, now_s: float) -> RequestContext:
    """The context on the receiving side's clock, at `now_s` when it arrived. The transfer time
    is not known, so it counts as zero: the deadline is at most that much later than sent."""
    deadline_s = None if wire.remaining_s is None else now_s + wire.remaining_s
    received_s = None if wire.age_s is None else now_s - wire.age_s
    return dataclasses.replace(wire.ctx, deadline_s=deadline_s, received_s=received_s)
