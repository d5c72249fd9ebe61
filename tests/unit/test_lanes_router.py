"""The lane router on fake lanes and a fake clock: the route and its `Fulcrum-Route` text, the
metrics it counts, deadlines read against the clock, variants and models without lanes."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from fulcrum.config import DynamicBatching, Lane, ModelConfig, Variant
from fulcrum.context import RequestContext
from fulcrum.errors import InvalidInput, NotFound, Unavailable
from fulcrum.lanes.router import LaneRouter, LaneTable
from fulcrum.router import Route
from fulcrum.types import FakeClock

CONFIG = ModelConfig(
    name="m",
    platform="echo",
    max_batch_size=8,
    variants={"fp32": Variant(), "int8": Variant()},
    lanes={
        "realtime": Lane(variant="int8", dynamic_batching=DynamicBatching(slo_p99_ms=20)),
        "bulk": Lane(variant="fp32", dynamic_batching=DynamicBatching(slo_p99_ms=500)),
    },
    default_lane="bulk",
)


class FakeLane:
    """A lane whose state the test sets; remembers when it was asked for its estimate."""

    def __init__(self, finish_s: float = 0.001) -> None:
        self.is_ready = True
        self.full = False
        self.finish_s = finish_s
        self.asked_at: list[float] = []

    def is_full(self, priority: int | None = None) -> bool:
        return self.full

    def estimate_finish_s(self, num_rows: int, now: float) -> float:
        self.asked_at.append(now)
        return self.finish_s


class Counted:
    def __init__(self, seen: list[tuple[str, ...]], labels: tuple[str, ...]) -> None:
        self.seen, self.label_values = seen, labels

    def inc(self, amount: float = 1) -> None:
        self.seen.append(self.label_values)


class FakeCounter:
    """Records the labels of every increment."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, ...]] = []

    def labels(self, *values: str) -> Counted:
        return Counted(self.seen, values)

    def remove(self, *values: str) -> None:
        self.seen = [labels for labels in self.seen if labels != values]


class Setup:
    def __init__(self) -> None:
        self.lanes = {"realtime": FakeLane(), "bulk": FakeLane()}
        self.counter = FakeCounter()
        self.clock = FakeClock(100.0)
        self.router = LaneRouter(self.lookup, self.counter, self.clock)

    def lookup(self, model: str, version: int | None) -> LaneTable | None:
        if model == "plain":
            return None
        if model != "m":
            raise NotFound(f"model '{model}' is not loaded")
        return LaneTable(CONFIG, self.lanes, {"realtime": 0.020, "bulk": 0.5})

    def route(self, model: str = "m", **fields: object) -> Route:
        ctx = RequestContext(request_id="r", tenant="t", api="v2")
        return self.router.route(dataclasses.replace(ctx, **fields), model, None)  # type: ignore[arg-type]


@pytest.fixture
def setup() -> Setup:
    return Setup()


def test_a_named_lane_is_routed_with_its_variant_and_header(setup: Setup) -> None:
    route = setup.route(lane="realtime")
    assert route == Route("m", None, "realtime", "int8", "lane=realtime; by=name")
    assert setup.counter.seen == [("m", "realtime", "routed")]


def test_the_deadline_is_read_against_the_clock(setup: Setup) -> None:
    route = setup.route(deadline_s=100.05)  # 50 ms left: only realtime promises that
    assert (route.lane, route.header) == ("realtime", "lane=realtime; by=deadline")
    assert setup.lanes["realtime"].asked_at == [100.0]
    assert setup.route(deadline_s=102.0).lane == "bulk"


def test_a_spill_is_in_the_header_and_the_metrics(setup: Setup) -> None:
    setup.lanes["bulk"].full = True
    route = setup.route()
    assert route.header == "lane=realtime; by=default; spilled-from=bulk"
    assert setup.counter.seen == [("m", "realtime", "spilled")]


def test_a_failover_is_in_the_header_and_the_metrics(setup: Setup) -> None:
    setup.lanes["realtime"].is_ready = False
    route = setup.route(lane="realtime")
    assert route.header == "lane=bulk; by=name; failed-over-from=realtime"
    assert setup.counter.seen == [("m", "bulk", "failed_over")]


def test_an_unloaded_models_counters_are_dropped(setup: Setup) -> None:
    setup.route(lane="realtime")
    setup.route()
    setup.router.forget("other")
    assert len(setup.counter.seen) == 2
    setup.router.forget("m")
    assert setup.counter.seen == []


def test_a_refusal_is_counted_against_the_home_lane(setup: Setup) -> None:
    for lane in setup.lanes.values():
        lane.full = True
    with pytest.raises(Unavailable):
        setup.route(deadline_s=100.05)  # its home: realtime, by deadline
    assert setup.counter.seen == [("m", "realtime", "refused")]


def test_a_named_variant_keeps_the_request_on_that_variants_lanes(setup: Setup) -> None:
    setup.lanes["realtime"].full = True
    setup.lanes["bulk"].finish_s = 0.0001  # on time, with room: no spill there all the same
    with pytest.raises(Unavailable):  # bulk runs fp32: no spill there
        setup.route(variant="int8")
    route = setup.route(variant="fp32")
    assert (route.lane, route.variant) == ("bulk", "fp32")
    with pytest.raises(InvalidInput, match="no lane over variant 'fp8'"):
        setup.route(variant="fp8")


def test_a_model_without_lanes_is_served_as_asked_and_refuses_a_lane(setup: Setup) -> None:
    assert setup.route("plain", variant="v") == Route("plain", None, None, "v")
    with pytest.raises(InvalidInput, match=r"model 'plain' has no lane 'fast' \(lanes: \[\]\)"):
        setup.route("plain", lane="fast")
    assert setup.counter.seen == []


def test_an_unknown_model_is_the_repositorys_404(setup: Setup) -> None:
    with pytest.raises(NotFound):
        setup.route("other")


class RowLane(FakeLane):
    """A lane whose estimate grows with the request's rows (a fixed cost plus a cost per row)."""

    def __init__(self, fixed_s: float, per_row_s: float) -> None:
        super().__init__()
        self.fixed_s, self.per_row_s = fixed_s, per_row_s
        self.rows_asked: list[int] = []

    def estimate_finish_s(self, num_rows: int, now: float) -> float:
        self.rows_asked.append(num_rows)
        return self.fixed_s + self.per_row_s * num_rows


def test_a_large_request_spills_where_a_one_row_request_would_not(setup: Setup) -> None:
    # Budget 0.6 s: home is bulk (the loosest SLO within it). One row there takes 0.11 s; 64
    # rows take 0.74 s, past the deadline, so they spill to realtime (0.065 s for 64 rows).
    bulk, realtime = RowLane(0.1, 0.01), RowLane(0.001, 0.001)
    setup.lanes.update(bulk=bulk, realtime=realtime)
    one = setup.route(deadline_s=100.6)
    assert one.header == "lane=bulk; by=deadline"
    many = setup.route(deadline_s=100.6, num_rows=64)
    assert many.header == "lane=realtime; by=deadline; spilled-from=bulk"
    assert bulk.rows_asked == [1, 64]


def test_an_unbatched_models_request_is_one_row(setup: Setup) -> None:
    lane = RowLane(0.1, 0.01)
    setup.lanes.update(bulk=lane, realtime=RowLane(0.1, 0.01))
    unbatched = msgspec.structs.replace(CONFIG, max_batch_size=0)
    router = LaneRouter(lambda m, v: LaneTable(unbatched, setup.lanes, {"realtime": 0.02,
                                                                       "bulk": 0.5}))  # fmt: skip
    router.route(RequestContext("r", "t", "v2", num_rows=64), "m", None)
    assert lane.rows_asked == [1]  # its first dimension is not rows
