"""One call from the ingress to a model's replicas through a deployment handle, bounded in time:
the replica's own errors come back as the Fulcrum errors they were; a replica that died (or a
deployment with none) is a 503; an idempotent call (v2 inference) is retried once first; a call
with no answer in time is cancelled and answered 504, so no request hangs on a lost replica."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fulcrum.errors import DeadlineExceeded, FulcrumError, Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")
# Ray's exception classes by name: the module stays importable (and testable) without Ray,
# and a fake raising a class of the same name is classified the same way.
_REPLICA_LOST = frozenset(
    {"RayActorError", "ActorDiedError", "ActorUnavailableError", "ReplicaUnavailableError",
     "NodeDiedError", "WorkerCrashedError", "ObjectLostError"}
)  # fmt: skip
_NO_REPLICA = frozenset({"DeploymentUnavailableError", "BackPressureError"})


class Cancellable(Protocol):
    """A pending answer that can be awaited and abandoned (Serve's `DeploymentResponse`)."""

    def __await__(self) -> Any: ...

    def cancel(self) -> None: ...


@dataclass(frozen=True, slots=True)
class CallPolicy:
    """How long the ingress waits for a replica, and whether a lost replica's call is retried."""

    timeout_s: float = 60.0  # no answer by then: cancelled, 504
    retry_lost: bool = True  # idempotent calls only: once, on another replica
    retry_after_s: float = 1.0  # the 503's Retry-After


async def forward(
    send: Callable[[], Cancellable], policy: CallPolicy, *, what: str, deadline_s: float | None
) -> Any:
    """`send()`'s answer; `deadline_s` (seconds left for the request, None: none) shortens the
    wait below `policy.timeout_s`. Errors are Fulcrum errors (see the module docstring)."""
    attempts = 2 if policy.retry_lost else 1
    for attempt in range(attempts):
        try:
            return await _bounded(send(), policy.timeout_s, deadline_s, what)
        except Exception as exc:
            if isinstance(exc, FulcrumError) and getattr(exc, "cause", None) is None:
                raise  # this side's own (the wait timed out)
            error = classify(exc, what, policy.retry_after_s)
            if is_lost(exc) and attempt + 1 < attempts:
                log.warning("%s: replica lost (%s); retrying once", what, type(exc).__name__)
                continue
            if error is getattr(exc, "cause", None):  # the replica's own error, unwrapped
                raise error from None
            raise error from exc
    raise AssertionError("unreachable: the loop returns or raises")


async def _bounded(
    response: Cancellable, timeout_s: float, deadline_s: float | None, what: str
) -> Any:
    wait_s = timeout_s if deadline_s is None else max(0.0, min(timeout_s, deadline_s))
    task: asyncio.Future[Any] = asyncio.ensure_future(_awaited(response))
    try:
        done, _ = await asyncio.wait({task}, timeout=wait_s)
    except BaseException:  # the caller was cancelled (client gone): abandon the replica's work
        task.cancel()
        response.cancel()
        raise
    if not done:
        task.cancel()
        response.cancel()
        raise DeadlineExceeded(f"{what}: no answer from the model's replica within {wait_s:.3g} s")
    return task.result()


async def _awaited(response: Awaitable[T]) -> T:
    return await response


def classify(exc: BaseException, what: str, retry_after_s: float = 1.0) -> FulcrumError:
    """The Fulcrum error a failed handle call stands for."""
    cause = getattr(exc, "cause", None)  # RayTaskError: what the replica raised
    if isinstance(cause, FulcrumError):
        return cause
    if isinstance(exc, FulcrumError):
        return exc
    name = type(exc).__name__
    if is_lost(exc):
        return Unavailable(
            f"{what}: the model's replica was lost mid-request; retry", retry_after_s=retry_after_s
        )
    if name in _NO_REPLICA:
        return Unavailable(
            f"{what}: no replica of the model can take the request now",
            retry_after_s=retry_after_s,
        )
    if isinstance(cause, BaseException):
        return FulcrumError(f"{what}: the model's replica failed: {type(cause).__name__}")
    return FulcrumError(f"{what}: the call to the model's replica failed: {name}")


def is_lost(exc: BaseException) -> bool:
    """Whether `exc` says the replica (its process or node) went away mid-call."""
    return any(c.__name__ in _REPLICA_LOST for c in type(exc).__mro__)
