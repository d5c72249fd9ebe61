"""Coalescing: concurrent identical misses compute once; a leader that fails or goes away
never takes its followers with it; a follower's own deadline still holds."""

from __future__ import annotations

import asyncio

import pytest

from fulcrum.cache.coalesce import Coalescer
from fulcrum.errors import DeadlineExceeded, ModelError


class Gate:
    """A computation that waits until opened; counts how often it ran."""

    def __init__(self, value: str = "v", fail_first: bool = False) -> None:
        self.opened = asyncio.Event()
        self.calls = 0
        self.value = value
        self.fail_first = fail_first

    async def __call__(self) -> str:
        self.calls += 1
        call = self.calls
        await self.opened.wait()
        if self.fail_first and call == 1:
            raise ModelError("the first run failed")
        return f"{self.value}{call}"


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_identical_concurrent_requests_compute_once() -> None:
    coalescer: Coalescer[str] = Coalescer()
    gate = Gate()
    runs = [asyncio.ensure_future(coalescer.run(b"k", gate)) for _ in range(5)]
    await settle()
    assert coalescer.num_in_flight == 1
    gate.opened.set()
    answers = await asyncio.gather(*runs)
    assert gate.calls == 1
    assert answers == [("v1", False)] + [("v1", True)] * 4
    assert coalescer.num_in_flight == 0


async def test_different_keys_are_not_coalesced() -> None:
    coalescer: Coalescer[str] = Coalescer()
    gate = Gate()
    runs = [asyncio.ensure_future(coalescer.run(k, gate)) for k in (b"a", b"b")]
    await settle()
    gate.opened.set()
    await asyncio.gather(*runs)
    assert gate.calls == 2


async def test_a_failed_leader_leaves_its_followers_to_compute_for_themselves() -> None:
    coalescer: Coalescer[str] = Coalescer()
    gate = Gate(fail_first=True)
    leader = asyncio.ensure_future(coalescer.run(b"k", gate))
    await settle()
    follower = asyncio.ensure_future(coalescer.run(b"k", gate))
    await settle()
    gate.opened.set()
    with pytest.raises(ModelError):
        await leader
    assert await follower == ("v2", False)  # its own run, not the leader's error


async def test_a_cancelled_leader_does_not_cancel_its_followers() -> None:
    coalescer: Coalescer[str] = Coalescer()
    gate = Gate()
    leader = asyncio.ensure_future(coalescer.run(b"k", gate))
    await settle()
    follower = asyncio.ensure_future(coalescer.run(b"k", gate))
    await settle()
    leader.cancel()
    await settle()
    gate.opened.set()
    assert await follower == ("v2", False)
    assert leader.cancelled()


async def test_a_follower_that_goes_away_does_not_cancel_the_leader() -> None:
    coalescer: Coalescer[str] = Coalescer()
    gate = Gate()
    leader = asyncio.ensure_future(coalescer.run(b"k", gate))
    await settle()
    follower = asyncio.ensure_future(coalescer.run(b"k", gate))
    await settle()
    follower.cancel()
    await settle()
    gate.opened.set()
    assert await leader == ("v1", False)


async def test_a_follower_waits_no_longer_than_its_own_deadline() -> None:
    coalescer: Coalescer[str] = Coalescer()
    gate = Gate()
    leader = asyncio.ensure_future(coalescer.run(b"k", gate))
    await settle()
    with pytest.raises(DeadlineExceeded):
        await coalescer.run(b"k", gate, timeout_s=0.0)
    gate.opened.set()
    assert await leader == ("v1", False)
