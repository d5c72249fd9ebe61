"""Model instances: each loaded copy runs its batches on its own single thread.

The batcher's `dispatch` is `InstancePool.run`: with N instances, N batches run at once and a
further batch waits (on the event loop, without polling) until one instance is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from fulcrum.backends import Backend
from fulcrum.types import TensorMap


class InstancePool:
    """Runs batches on free instances; one single-thread executor per instance."""

    def __init__(self, backends: Sequence[Backend], *, name: str) -> None:
        if not backends:
            raise ValueError("an instance pool needs at least one backend")
        self.name = name
        self._backends = list(backends)
        self._executors = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-instance-{i}")
            for i in range(len(self._backends))
        ]
        self._free: deque[int] = deque(range(len(self._backends)))
        self._slots = asyncio.Semaphore(len(self._backends))
        self._closed = False

    @property
    def num_instances(self) -> int:
        return len(self._backends)

    @property
    def num_free(self) -> int:
        return len(self._free)

    async def run(self, inputs: TensorMap) -> TensorMap:
        """Wait for a free instance, then run `backend.execute(inputs)` on its thread."""
        await self._slots.acquire()
        index = self._free.popleft()
        loop = asyncio.get_running_loop()
        try:
            job = self._executors[index].submit(self._backends[index].execute, inputs)
        except BaseException:
            self._release(index)
            raise
        # Release the GIL for a moment so the instance thread starts the batch now rather than
        # after the event loop's next callbacks (measured: ~0.15 ms less idle per batch).
        time.sleep(0)
        try:
            return await asyncio.wrap_future(job)
        finally:
            if job.done():
                self._release(index)
            else:
                # The caller gave up but the thread still runs the batch: the instance is free
                # only when it finishes, or a later batch would queue behind it unseen.
                job.add_done_callback(lambda _: self._release_from_thread(loop, index))

    def close(self) -> None:
        """Shut the executors down (after the batch each one runs), then close the backends."""
        if self._closed:
            return
        self._closed = True
        for executor in self._executors:
            executor.shutdown(wait=True, cancel_futures=True)
        for backend in self._backends:
            backend.close()

    def _release_from_thread(self, loop: asyncio.AbstractEventLoop, index: int) -> None:
        # A closed loop raises RuntimeError: then nobody waits for this instance any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._release, index)

    def _release(self, index: int) -> None:
        self._free.append(index)
        self._slots.release()
