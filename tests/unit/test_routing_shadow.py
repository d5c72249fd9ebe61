"""Shadow traffic on fakes: agreement recorded, the bound (max_in_flight, a full reference),
drops and failures counted, the lowest priority, and `close` cancelling what runs."""

from __future__ import annotations

import asyncio
import random

import numpy as np
from prometheus_client import CollectorRegistry

from fulcrum.batch_request import InferResult
from fulcrum.config import DynamicBatching, ModelConfig, TensorSpec
from fulcrum.errors import ModelError, NotFound
from fulcrum.routing.metrics import RoutingMetrics
from fulcrum.routing.settings import ShadowSettings
from fulcrum.routing.shadow import ShadowRunner
from fulcrum.types import TensorMap

CONFIG = ModelConfig(
    name="m", platform="echo", max_batch_size=8,
    outputs=(TensorSpec(name="y", datatype="FP32", shape=(3,)),),
    dynamic_batching=DynamicBatching(priority_levels=3),
)  # fmt: skip
SETTINGS = ShadowSettings(variant="fp32", fraction=1.0, max_in_flight=2, compare="top1")


class FakeReference:
    """A reference servable: answers `answer` once `gate` opens; records each call's priority."""

    def __init__(self, answer: np.ndarray, *, full: bool = False, fails: bool = False) -> None:
        self.config = CONFIG
        self.is_ready = True
        self.full = full
        self.queue_depth = 0
        self.fails = fails
        self.answer = answer
        self.gate = asyncio.Event()
        self.gate.set()
        self.priorities: list[int | None] = []

    def is_full(self, priority: int | None = None) -> bool:
        return self.full

    async def infer(
        self, inputs: TensorMap, *, priority: int | None, timeout_s: float | None,
        age_s: float = 0.0,
    ) -> InferResult:  # fmt: skip
        self.priorities.append(priority)
        await self.gate.wait()
        if self.fails:
            raise ModelError("boom")
        return InferResult({"y": self.answer}, 0.0, 0.0, 1)


def caller_result() -> InferResult:
    return InferResult({"y": np.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1]], np.float32)}, 0, 0, 2)


def runner() -> tuple[ShadowRunner, RoutingMetrics]:
    metrics = RoutingMetrics(CollectorRegistry())
    return ShadowRunner(metrics, random.Random(0)), metrics


INPUTS = {"x": np.zeros((2, 1), np.float32)}


async def test_top1_agreement_of_a_reference_that_differs_on_one_row() -> None:
    shadows, metrics = runner()
    reference = FakeReference(np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], np.float32))
    assert shadows.offer(reference, SETTINGS, lambda: reference, INPUTS, caller_result())
    await shadows.wait()
    stats = metrics.stats_json("m")["shadow"]
    assert stats == {"reference": "fp32", "sent": 1, "dropped": 0, "failed": 0, "sampled": 0,
                     "compared": 1,
                     "agreement_mean": 0.5}  # fmt: skip
    assert reference.priorities == [3]  # the lowest of the model's three levels


async def test_the_caller_is_not_waited_for_and_the_bound_drops_the_rest() -> None:
    shadows, metrics = runner()
    reference = FakeReference(caller_result().outputs["y"])
    reference.gate.clear()  # a slow reference
    started = [shadows.offer(reference, SETTINGS, lambda: reference, INPUTS, caller_result())
               for _ in range(50)]  # fmt: skip
    await asyncio.sleep(0)  # let the shadows reach the reference
    assert started.count(True) == 2 and shadows.in_flight("m") == 2
    stats = metrics.stats_json("m")["shadow"]
    assert (stats["sent"], stats["dropped"], stats["compared"]) == (2, 48, 0)
    reference.gate.set()
    await shadows.wait()
    assert metrics.stats_json("m")["shadow"]["agreement_mean"] == 1.0
    assert shadows.in_flight("m") == 0


async def test_a_full_reference_gets_no_shadow() -> None:
    shadows, metrics = runner()
    reference = FakeReference(caller_result().outputs["y"], full=True)
    assert not shadows.offer(reference, SETTINGS, lambda: reference, INPUTS, caller_result())
    assert reference.priorities == []
    assert metrics.stats_json("m")["shadow"]["dropped"] == 1


async def test_failures_and_a_missing_reference_are_counted() -> None:
    shadows, metrics = runner()
    reference = FakeReference(caller_result().outputs["y"], fails=True)
    shadows.offer(reference, SETTINGS, lambda: reference, INPUTS, caller_result())
    await shadows.wait()

    def missing() -> FakeReference:
        raise NotFound("not loaded")

    assert not shadows.offer(reference, SETTINGS, missing, INPUTS, caller_result())
    assert metrics.stats_json("m")["shadow"]["failed"] == 2
    assert shadows.in_flight("m") == 0


async def test_the_fraction_samples_requests() -> None:
    shadows, _ = runner()
    reference = FakeReference(caller_result().outputs["y"])
    tenth = ShadowSettings(variant="fp32", fraction=0.1, max_in_flight=1000)
    sent = sum(shadows.offer(reference, tenth, lambda: reference, INPUTS, caller_result())
               for _ in range(2000))  # fmt: skip
    assert 200 - 4 * 13.4 <= sent <= 200 + 4 * 13.4  # binomial(2000, 0.1): sigma 13.4
    await shadows.wait()


async def test_close_cancels_the_running_shadows_and_starts_no_more() -> None:
    shadows, _ = runner()
    reference = FakeReference(caller_result().outputs["y"])
    reference.gate.clear()
    shadows.offer(reference, SETTINGS, lambda: reference, INPUTS, caller_result())
    await asyncio.sleep(0)
    await shadows.close()
    assert shadows.in_flight("m") == 0
    assert not shadows.offer(reference, SETTINGS, lambda: reference, INPUTS, caller_result())


async def test_a_shadow_closed_before_its_first_step_still_leaves_the_count() -> None:
    """The server stops right after the answer went out: the shadow never ran a step."""
    shadows, _ = runner()
    reference = FakeReference(caller_result().outputs["y"])
    assert shadows.offer(reference, SETTINGS, lambda: reference, INPUTS, caller_result())
    assert shadows.in_flight("m") == 1
    await shadows.close()  # no yield before: the task is cancelled before it starts
    assert shadows.in_flight("m") == 0
    assert reference.priorities == []


async def test_with_one_priority_level_a_backlogged_reference_gets_no_shadow() -> None:
    shadows, metrics = runner()
    reference = FakeReference(caller_result().outputs["y"])
    reference.config = ModelConfig(name="m", platform="echo", max_batch_size=8,
                                   outputs=CONFIG.outputs)  # fmt: skip
    reference.queue_depth = 1  # real requests wait: a shadow would go ahead of later ones
    assert not shadows.offer(reference, SETTINGS, lambda: reference, INPUTS, caller_result())
    reference.queue_depth = 0
    assert shadows.offer(reference, SETTINGS, lambda: reference, INPUTS, caller_result())
    await shadows.wait()
    assert reference.priorities == [1]
    assert metrics.stats_json("m")["shadow"]["dropped"] == 1
