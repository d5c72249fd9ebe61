"""Failure isolation: a failed batch's requests re-run in halves until each failure stands alone.

Triton's python_backend answers every request of a batch on its own; a backend that raises for a
whole batch cannot, so the batcher finds the requests that fail by bisection instead.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from fulcrum.errors import DeadlineExceeded, ExecutionTimeout, ModelError, Unavailable

_logger = logging.getLogger(__name__)

T = TypeVar("T")


def may_rerun(error: Exception) -> bool:
    """Whether running the requests again could help: not when the model is gone or hung."""
    return not isinstance(error, (Unavailable, DeadlineExceeded, ExecutionTimeout))


async def isolate(
    group: Sequence[T],
    run: Callable[[list[T]], Awaitable[None]],
    fail: Callable[[list[T], Exception], None],
    is_live: Callable[[T], bool],
) -> None:
    """Re-run a failed group's live items as two halves, in turn; halve again what fails.

    `run` dispatches a list as one batch and answers its items, or raises; `fail` answers items
    with the error of the run they failed in. Items `is_live` rejects (cancelled callers) are
    never re-run. One failing item among n costs at most 2 * ceil(log2 n) runs (two per level),
    a whole group at most 2n - 2; every other item gets the answer it gets alone.
    """
    live = [item for item in group if is_live(item)]
    middle = (len(live) + 1) // 2
    for half in (live[:middle], live[middle:]):
        half = [item for item in half if is_live(item)]  # cancelled while the other half ran
        if not half:
            continue
        try:
            await run(half)
        except Exception as exc:
            if len(half) > 1 and may_rerun(exc):
                await isolate(half, run, fail, is_live)
            else:
                fail(half, exc)


def shared_error(model: str, error: Exception, num_requests: int) -> ModelError:
    """The error every request of a failed batch gets when isolation is off.

    Nobody can tell whose failure it is, and the error text may quote another request's data,
    so the callers get a neutral error and the log gets the cause.
    """
    _logger.warning(
        "model %s: a batch of %d requests failed: %s: %s",
        model,
        num_requests,
        type(error).__name__,
        error,
    )
    neutral = ModelError(
        f"model {model!r} failed on a batch of {num_requests} requests that held this one "
        "(failure isolation is off; the cause is in the server log)"
    )
    neutral.__cause__ = error
    return neutral
