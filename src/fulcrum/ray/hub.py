"""Asking every replica at once. Serve's handles reach one replica of their choice, so each
replica keeps a long poll open on this small deployment; a collection (the statistics API,
`/metrics`) wakes them all, each answers with its figures, and the hub returns what arrived
within a bound. A replica that does not answer in time (it died) is forgotten until it polls
again. Only asyncio here: the class is plain, and `fulcrum.ray.app` makes it a deployment."""

from __future__ import annotations

import asyncio
import contextlib
import time

from fulcrum.ray.aggregate import ReplicaSnapshot

POLL_S = 30.0  # an idle poll returns after this, and the replica polls again
FORGET_S = 2 * POLL_S  # a replica silent this long is gone (it always polls again sooner)


class StatsHub:
    """Epoch-numbered collections; replicas answer the newest epoch they were woken for."""

    def __init__(self, poll_s: float = POLL_S) -> None:
        self._poll_s = poll_s
        self._epoch = 0
        self._woken = asyncio.Event()  # replaced after each wake-up
        self._seen: dict[str, tuple[str, float]] = {}  # replica -> (model, last poll time)
        self._answers: dict[int, dict[str, ReplicaSnapshot]] = {}
        self._arrived = asyncio.Condition()

    async def poll(self, replica: str, model: str, last_epoch: int) -> int:
        """The epoch to answer: a newer one than `last_epoch` as soon as a collection starts,
        or `last_epoch` again after `poll_s` with none."""
        self._seen[replica] = (model, time.monotonic())
        if self._epoch > last_epoch:
            return self._epoch
        woken = self._woken
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(woken.wait(), self._poll_s)
        self._seen[replica] = (model, time.monotonic())
        return self._epoch

    async def answer(self, epoch: int, snapshot: ReplicaSnapshot) -> None:
        answers = self._answers.get(epoch)
        if answers is None:  # the collection already returned
            return
        answers[snapshot.replica] = snapshot
        async with self._arrived:
            self._arrived.notify_all()

    async def collect(self, model: str | None, timeout_s: float = 2.0) -> list[ReplicaSnapshot]:
        """Every live replica's snapshot (of `model`'s replicas, or all), waiting at most
        `timeout_s` for them."""
        now = time.monotonic()
        for replica, (_, seen_s) in list(self._seen.items()):
            if now - seen_s > FORGET_S:
                del self._seen[replica]
        expected = {r for r, (m, _) in self._seen.items() if model is None or m == model}
        self._epoch += 1
        epoch = self._epoch
        answers: dict[str, ReplicaSnapshot] = {}
        self._answers[epoch] = answers
        woken, self._woken = self._woken, asyncio.Event()
        woken.set()
        try:
            async with self._arrived:
                await asyncio.wait_for(
                    self._arrived.wait_for(lambda: expected <= set(answers)), timeout_s
                )
        except TimeoutError:
            for replica in expected - set(answers):
                self._seen.pop(replica, None)  # dead (or stuck): until it polls again
        finally:
            del self._answers[epoch]
        return [s for s in answers.values() if model is None or s.model == model]

    async def replicas(self) -> dict[str, str]:
        """Replica -> model, for every replica that polled lately."""
        return {replica: model for replica, (model, _) in self._seen.items()}
