"""Model instances: each loaded copy runs its batches on its own single thread, under a watchdog.

The batcher's `dispatch` is `InstancePool.run`: with N instances, N batches run at once and a
further batch waits (on the event loop, without polling) until one instance is free. A batch that
runs past the execution limit fails, and its instance is set aside as hung until it returns.
`run_lone` takes a backend's `execute_lone` path when every other instance is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from fulcrum.backends import Backend, LoneBatchBackend, distinct
from fulcrum.errors import ExecutionTimeout, Unavailable
from fulcrum.thread_priority import compute_initializer
from fulcrum.types import TensorMap

_logger = logging.getLogger(__name__)


class InstancePool:
    """Runs batches on free instances; one single-thread executor per instance."""

    def __init__(
        self,
        backends: Sequence[Backend],
        *,
        name: str,
        execution_timeout_s: float | None = None,
        compute_nice: int = 0,  # nice steps below this thread for the instance threads
    ) -> None:
        if not backends:
            raise ValueError("an instance pool needs at least one backend")
        self.name = name
        self.execution_timeout_s = execution_timeout_s or None  # None or 0: no limit
        self._backends = list(backends)
        # Each backend's path for a batch that runs alone (None: it has none), found once: a
        # runtime Protocol check costs microseconds, too much for every batch.
        self._lone_paths: list[Callable[[TensorMap], TensorMap] | None] = [
            b.execute_lone if isinstance(b, LoneBatchBackend) else None for b in self._backends
        ]
        self._executors = [
            ThreadPoolExecutor(1, f"{name}-instance-{i}", compute_initializer(compute_nice))
            for i in range(len(self._backends))
        ]
        self._jobs: list[Future[TensorMap] | None] = [None] * len(self._backends)
        self._free: deque[int] = deque(range(len(self._backends)))
        self._waiters: deque[asyncio.Future[int]] = deque()
        self._hung: set[int] = set()
        self._closed = False

    @property
    def num_instances(self) -> int:
        return len(self._backends)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_hung(self) -> int:
        """Instances whose thread is still stuck in a batch that ran past the execution limit."""
        return len(self._hung)

    @property
    def is_healthy(self) -> bool:
        """False when every instance is hung: the model cannot run anything (not ready)."""
        return len(self._hung) < len(self._backends)

    def lone_states(self) -> list[dict[str, object]]:
        """Each distinct backend's lone-batch state (`lone_state()`), where it reports one."""
        states = []
        for backend in distinct(self._backends):
            report = getattr(backend, "lone_state", None)
            state = report() if callable(report) else None
            if state is not None:
                states.append(state)
        return states

    @property
    def lone_dispatch(self) -> Callable[[TensorMap], Awaitable[TensorMap]] | None:
        """`run_lone` when a backend has a path for a batch that runs alone, else None."""
        if any(path is not None for path in self._lone_paths):
            return self.run_lone
        return None

    async def run_lone(self, inputs: TensorMap) -> TensorMap:
        """`run` for a batch that nothing waits behind: the backend's `execute_lone` path is
        taken when, once it has an instance, every other instance is free too."""
        return await self.run(inputs, lone=True)

    async def run(self, inputs: TensorMap, *, lone: bool = False) -> TensorMap:
        """Wait for a free instance, then run `backend.execute(inputs)` on its thread.

        Raises Unavailable (503) at once when every instance is hung, and ExecutionTimeout (500)
        when this batch runs past the execution limit.
        """
        index = await self._acquire()
        loop = asyncio.get_running_loop()
        backend = self._backends[index]
        execute: Callable[[TensorMap], TensorMap] = backend.execute
        lone_path = self._lone_paths[index]
        if lone and lone_path is not None and self._others_idle():
            execute = lone_path
        try:
            job = self._executors[index].submit(execute, inputs)
        except BaseException:
            self._release(index)
            raise
        self._jobs[index] = job
        # Release the GIL for a moment so the instance thread starts the batch now rather than
        # after the event loop's next callbacks (measured: ~0.15 ms less idle per batch).
        time.sleep(0)
        waiter = asyncio.wrap_future(job)
        try:
            return await self._watch(index, job, waiter)
        finally:
            waiter.cancel()  # if still pending, nobody reads it: its outcome is not logged
            if job.done():
                self._release(index)
            else:
                # The caller gave up or the watchdog fired, but the thread still runs the batch:
                # the instance is free only when it returns, or a later batch would queue behind
                # it unseen. A Python thread cannot be killed, so that is all there is to do.
                job.add_done_callback(lambda _: self._release_from_thread(loop, index))

    def close(self) -> None:
        """Shut the executors down (after the batch each one runs), then close the backends.

        A hung instance is not waited for: its backend is closed when its thread returns (a
        backend shared between instances, when the last of their hung threads returns).
        """
        if self._closed:
            return
        self._closed = True
        hung = set(self._hung)  # called off the event loop: read it once
        stuck: dict[int, list[Future[TensorMap]]] = {}  # id(backend) -> its hung jobs
        for index, backend in enumerate(self._backends):
            job = self._jobs[index]
            if index in hung and job is not None:
                self._executors[index].shutdown(wait=False, cancel_futures=True)
                stuck.setdefault(id(backend), []).append(job)
            else:
                self._executors[index].shutdown(wait=True, cancel_futures=True)
        for backend in distinct(self._backends):
            jobs = stuck.get(id(backend))
            if jobs:
                _close_after(backend, jobs)
            else:
                backend.close()

    async def _watch(
        self, index: int, job: Future[TensorMap], waiter: asyncio.Future[TensorMap]
    ) -> TensorMap:
        limit_s = self.execution_timeout_s
        if limit_s is None:
            return await waiter
        # A timer that cancels the wait, rather than asyncio.wait: no extra future, callback
        # and loop turn between the batch's end and its caller on every batch.
        fired: list[bool] = []

        def expire() -> None:
            fired.append(True)
            waiter.cancel()  # a running job cannot be cancelled: it goes on in its thread

        timer = asyncio.get_running_loop().call_later(limit_s, expire)
        try:
            return await waiter
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not fired or (task is not None and task.cancelling()):
                raise  # the caller's own cancellation
        finally:
            timer.cancel()
        if job.done() and not job.cancelled():  # it returned just as the limit passed
            return job.result()
        self._mark_hung(index)
        raise ExecutionTimeout(
            f"model {self.name!r} exceeded its execution limit of {limit_s * 1000:g} ms; "
            f"instance {index} is set aside as hung"
        )

    def _others_idle(self) -> bool:
        # Hung instances are not free either: their threads still hold the cores.
        return not self._waiters and len(self._free) == len(self._backends) - 1

    async def _acquire(self) -> int:
        if not self.is_healthy:
            raise self._unavailable()
        if self._free:
            return self._free.popleft()
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release(waiter.result())  # handed an instance just as the caller left
            raise

    def _mark_hung(self, index: int) -> None:
        self._hung.add(index)
        _logger.error(
            "model %s: instance %d ran past its execution limit; %d of %d instances hung",
            self.name,
            index,
            len(self._hung),
            len(self._backends),
        )
        if not self.is_healthy:
            # Nobody will release an instance for the batches waiting: fail them now.
            error = self._unavailable()
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(error)

    def _unavailable(self) -> Unavailable:
        return Unavailable(
            f"model {self.name!r} has no healthy instance: all {len(self._backends)} are hung "
            "past the execution limit (one that returns serves again; or reload the model)"
        )

    def _release_from_thread(self, loop: asyncio.AbstractEventLoop, index: int) -> None:
        # A closed loop raises RuntimeError: then nobody waits for this instance any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._release, index)

    def _release(self, index: int) -> None:
        self._jobs[index] = None  # the finished job holds the batch's outputs
        if index in self._hung:
            # The stuck call returned at last: the instance serves again.
            self._hung.discard(index)
            _logger.warning(
                "model %s: hung instance %d returned; back in service", self.name, index
            )
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(index)  # hand over directly: FIFO among waiting batches
                return
        self._free.append(index)


def _close_after(backend: Backend, jobs: list[Future[TensorMap]]) -> None:
    """Close `backend` once every one of `jobs` (its hung calls) has returned."""
    remaining = [len(jobs)]
    lock = threading.Lock()

    def one_done(_: object) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            _close_quietly(backend, None)

    for job in jobs:
        job.add_done_callback(one_done)


def _close_quietly(backend: Backend, _: object) -> None:
    try:
        backend.close()
    except Exception:
        _logger.exception("closing a backend after its hung call returned failed")
