"""The A/B split: ratios within binomial bounds over many keys, sticky keys, weights of 0,
arms in any file order, and the router: the arm in the route, explicit choices winning, arms
by version, the tenant as the key."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fulcrum.config import ModelConfig
from fulcrum.context import RequestContext
from fulcrum.router import Route
from fulcrum.routing.ab import AbRouter, arm_of, split_point
from fulcrum.routing.settings import AbSettings, RoutingSettings

NUM_KEYS = 10_000


@pytest.mark.parametrize("weights", [{"fp32": 0.9, "int8": 0.1}, {"a": 1.0, "b": 2.0, "c": 1.0}])
def test_each_arm_gets_its_share_within_four_sigma(weights: dict[str, float]) -> None:
    counts = dict.fromkeys(weights, 0)
    for i in range(NUM_KEYS):
        counts[arm_of("model", f"key-{i}", weights)] += 1
    total = sum(weights.values())
    for arm, weight in weights.items():
        p = weight / total
        sigma = math.sqrt(NUM_KEYS * p * (1 - p))
        assert abs(counts[arm] - NUM_KEYS * p) <= 4 * sigma, (arm, counts)


def test_a_key_keeps_its_arm_and_file_order_moves_no_one() -> None:
    forward = {"fp32": 0.5, "int8": 0.5}
    backward = {"int8": 0.5, "fp32": 0.5}
    arms = [arm_of("m", f"k{i}", forward) for i in range(200)]
    assert arms == [arm_of("m", f"k{i}", forward) for i in range(200)]
    assert arms == [arm_of("m", f"k{i}", backward) for i in range(200)]
    assert set(arms) == {"fp32", "int8"}


def test_the_point_is_stable_across_processes() -> None:
    # Pinned: SHA-256 of "m\0user-1", not Python's per-process salted hash(); a change here
    # would move every user to another arm on upgrade.
    assert split_point("m", "user-1") == pytest.approx(0.4440670868043604, abs=1e-15)
    assert [arm_of("m", f"user-{i}", {"fp32": 0.5, "int8": 0.5}) for i in range(4)] == [
        "fp32", "fp32", "int8", "fp32"]  # fmt: skip
    assert split_point("m", "user-1") != split_point("other", "user-1")  # experiments differ


def test_an_arm_of_weight_zero_gets_no_one() -> None:
    assert {arm_of("m", f"k{i}", {"a": 1.0, "b": 0.0}) for i in range(500)} == {"a"}


class FakeInner:
    """The inner router: records what it was asked, serves it as asked."""

    def __init__(self, header: str | None = None) -> None:
        self.asked: list[tuple[RequestContext, int | None]] = []
        self.header = header

    def route(self, ctx: RequestContext, model: str, version: int | None) -> Route:
        self.asked.append((ctx, version))
        return Route(model, version, ctx.lane, ctx.variant, self.header)


def config_with(ab: AbSettings | None) -> ModelConfig:
    return ModelConfig(name="m", platform="echo", routing=RoutingSettings(ab=ab))


def ctx(**fields: object) -> RequestContext:
    return dataclasses.replace(RequestContext("r", "tenant-1", "v2"), **fields)  # type: ignore[arg-type]


SPLIT = AbSettings(arms={"fp32": 0.5, "int8": 0.5})


def test_the_router_sends_the_arm_as_the_variant_and_names_it() -> None:
    inner = FakeInner()
    router = AbRouter(inner, lambda model, version: config_with(SPLIT))
    route = router.route(ctx(ab_key="user-7"), "m", None)
    arm = arm_of("m", "user-7", SPLIT.arms)
    assert (route.arm, route.variant, route.header) == (arm, arm, f"ab={arm}")
    assert inner.asked[0][0].variant == arm


def test_the_tenant_is_the_key_without_one() -> None:
    router = AbRouter(FakeInner(), lambda model, version: config_with(SPLIT))
    assert router.route(ctx(), "m", None).arm == arm_of("m", "tenant-1", SPLIT.arms)


def test_lanes_follow_the_arm_in_the_header() -> None:
    router = AbRouter(FakeInner("lane=bulk; by=variant"), lambda m, v: config_with(SPLIT))
    route = router.route(ctx(ab_key="k"), "m", None)
    assert route.header == f"ab={route.arm}; lane=bulk; by=variant"


@pytest.mark.parametrize("explicit", [{"variant": "fp32"}, {"lane": "bulk"}])
def test_an_explicit_variant_or_lane_wins(explicit: dict[str, str]) -> None:
    inner = FakeInner()
    router = AbRouter(inner, lambda model, version: config_with(SPLIT))
    route = router.route(ctx(ab_key="k", **explicit), "m", None)
    assert route.arm is None and route.header is None
    assert inner.asked[0][0] == ctx(ab_key="k", **explicit)


def test_arms_by_version_and_an_explicit_version_wins() -> None:
    by_version = AbSettings(arms={"1": 1.0, "2": 3.0}, by="version")
    inner = FakeInner()
    router = AbRouter(inner, lambda model, version: config_with(by_version))
    route = router.route(ctx(ab_key="k"), "m", None)
    assert route.version == int(arm_of("m", "k", by_version.arms)) == int(str(route.arm))
    explicit = router.route(ctx(ab_key="k"), "m", 1)
    assert (explicit.version, explicit.arm) == (1, None)


def test_a_model_without_a_split_is_served_as_asked() -> None:
    router = AbRouter(FakeInner(), lambda model, version: config_with(None))
    assert router.route(ctx(ab_key="k"), "m", None) == Route("m", None, None, None)
