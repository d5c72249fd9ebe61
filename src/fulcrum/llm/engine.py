"""AsyncLLMEngine: the step loop on ONE dedicated thread, tokens handed to each request's asyncio
queue with `call_soon_threadsafe`. The thread sleeps on an event while idle (never polls); a
cancelled stream aborts its sequence within a step; a crashed thread fails its requests clearly
and is restarted by its supervisor (`fulcrum.llm.supervisor`), reusing the loaded weights."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fulcrum.errors import FulcrumError, InvalidInput, ModelError, QueueFull, Unavailable
from fulcrum.llm.async_text import AsyncTextFront
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.outputs import RequestOutput
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.supervisor import RestartPolicy, RestartTracker
from fulcrum.llm.sync_engine import LLMEngine

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from fulcrum.config import ModelConfig

__all__ = ["AsyncLLMEngine", "LLMEngine"]

log = logging.getLogger(__name__)
_Item = RequestOutput | BaseException


@dataclass(frozen=True, slots=True)
class _Add:
    """A request handed from the event loop to the engine thread."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_s: float


class AsyncLLMEngine(AsyncTextFront):
    """One model's engine for the server: `generate` streams RequestOutputs."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        model_name: str,
        version: int = 1,
        restart_policy: RestartPolicy | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.version = version
        self._commands: list[_Add | str] = []  # str: a request id to abort
        self._lock = threading.Lock()  # guards _commands
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue[_Item]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = False
        self._error: BaseException | None = None
        self._num_waiting = 0  # the scheduler's count, published by the engine thread
        # Python >= 3.10 binds an asyncio.Event to a loop on first use, not here, so this
        # constructor may run in a worker thread (from_config under asyncio.to_thread).
        self._idle = asyncio.Event()
        self._restarts = RestartTracker(restart_policy or RestartPolicy())
        self._restart_task: asyncio.Task[None] | None = None
        self._retry_after_s = 1.0  # the backoff left when the engine went down
        self._given_up = False  # too many restarts: down until the model is reloaded
        self._reset_pending = False  # the next engine thread resets the crashed engine first

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        version_dir: Path,
        *,
        version: int = 1,
        variant: str = "default",
        registry: CollectorRegistry | None = None,
    ) -> AsyncLLMEngine:
        """Build from a `platform = "llm"` model: parameters from config.toml, weights from disk.
        Blocking (weights, KV pool, kernel compilation) and loop-free: call it in a worker
        thread; `start` then only starts the engine thread."""
        from prometheus_client import CollectorRegistry

        params = EngineParams.from_parameters(dict(config.parameters))
        metrics = LLMMetrics(registry or CollectorRegistry(), config.name, version, variant)
        try:
            engine = LLMEngine.from_checkpoint(version_dir, params, metrics=metrics)
        except BaseException:
            metrics.remove()  # a failed load leaves no series behind
            raise
        return cls(engine, model_name=config.name, version=version)

    @property
    def is_healthy(self) -> bool:
        """False before start, while a crashed engine thread waits for its restart, and for good
        once it crashed too often (readiness goes off)."""
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def num_restarts(self) -> int:
        """Engine threads restarted after a crash."""
        return self._restarts.num_restarts

    @property
    def num_streams(self) -> int:
        """Requests admitted whose output streams are still open."""
        return len(self._streams)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def abort(self, request_id: str) -> None:
        """Abort an admitted request whose stream will never be read; unknown ids are ignored."""
        self._forget(request_id)
        self._submit(request_id)

    async def start(self) -> None:
        """Start the engine thread."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self._idle.set()
        self._thread = threading.Thread(
            target=self._run, name=f"llm-engine-{self.model_name}", daemon=True
        )
        self._thread.start()

    async def stop(self, timeout_s: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish (bounded), abort the rest, join, and
        drop this model version's metric series."""
        self._accepting = False
        await self._cancel_restart()
        drain_s = self.engine.params.drain_timeout_s if timeout_s is None else timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), drain_s)
        self._fail_all(Unavailable(f"model {self.model_name!r} is shutting down"))
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, max(drain_s, 1.0))
        if self.engine.metrics is not None:
            self.engine.metrics.remove()

    def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Admit a request now (raising InvalidInput, QueueFull, Shed or Unavailable at the call)
        and stream its outputs; closing or cancelling the iterator aborts the request."""
        request_id = request_id or uuid.uuid4().hex
        queue = self._admit(prompt, sampling, request_id, priority, cache_salt)
        return self._stream(request_id, queue)

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[_Item]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already forgot the request
                    raise item
                finished = item.finished
                yield item
        finally:
            self._forget(request_id)
            if not finished:  # cancelled or closed by the consumer: a client went away
                self._submit(request_id)

    def _admit(
        self,
        prompt: str | list[int],
        sampling: SamplingParams,
        request_id: str,
        priority: int,
        cache_salt: str | None,
    ) -> asyncio.Queue[_Item]:
        if not self.is_healthy:
            raise self._down_error()
        if not self._accepting:
            raise Unavailable(f"model {self.model_name!r} is shutting down")
        if request_id in self._streams:
            raise InvalidInput(f"request id {request_id!r} is already in use")
        token_ids = self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
        # Validate here, before queueing, so a bad request fails alone and at once.
        self.engine.check_request(token_ids, sampling)
        with self._lock:
            pending = [c for c in self._commands if isinstance(c, _Add)]
        max_waiting = self.engine.params.max_num_waiting
        if self._num_waiting + len(pending) >= max_waiting:
            if self.engine.metrics is not None:
                self.engine.metrics.request_shed("queue_full")
            raise QueueFull(f"model {self.model_name!r}: {max_waiting} requests already waiting")
        # Shed here, at the call, from the state the engine thread last published.
        self.engine.check_admission(len(token_ids), sum(len(c.token_ids) for c in pending))
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._streams[request_id] = queue
        self._idle.clear()
        arrival_s = self.engine.clock.now()
        self._submit(_Add(request_id, token_ids, sampling, priority, cache_salt, arrival_s))
        return queue

    def _submit(self, command: _Add | str) -> None:
        with self._lock:
            self._commands.append(command)
        self._wake.set()

    # --- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._reset_pending:  # here, not on the loop: a reset frees and rebuilds state
                self._reset_pending = False
                self.engine.reset()
            while not self._stopping:
                self._wake.clear()
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait()
                    continue
                outputs = self.engine.step()
                self._num_waiting = self.engine.num_waiting
                if outputs:
                    self._publish(outputs)
            self._apply_commands()
            self.engine.abort_all()  # stop() already failed their streams; free the blocks
        except BaseException as exc:
            log.exception("LLM engine %r died", self.model_name)
            self._error = exc
            self._call_in_loop(self._on_crash, exc)

    def _apply_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for command in commands:
            if isinstance(command, str):
                self.engine.abort(command)
                continue
            try:
                self.engine.add_request(
                    command.request_id,
                    command.token_ids,
                    command.sampling,
                    priority=command.priority,
                    cache_salt=command.cache_salt,
                    arrival_s=command.arrival_s,
                    check_slo=False,  # checked at admission; the queue ahead is not its fault
                )
            except FulcrumError as exc:  # QueueFull or InvalidInput: fails only this request
                self._call_in_loop(self._deliver_error, command.request_id, exc)
        self._num_waiting = self.engine.num_waiting

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self._call_in_loop(self._deliver, outputs)

    def _call_in_loop(self, callback: Callable[..., object], *args: object) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # RuntimeError: the loop closed meanwhile, so nobody is left to tell.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(callback, *args)

    # --- event loop ----------------------------------------------------------------------

    # A stream's queue leaves `_streams` with its last item: its iterator holds the queue, so
    # even an iterator that is never started cannot keep a finished request alive.

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.error is not None:  # this request alone failed in its step
                self._deliver_error(output.request_id, output.error)
                continue
            queue = self._streams.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
                if output.finished:
                    self._forget(output.request_id)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(exc)
            self._forget(request_id)

    def _fail_all(self, exc: FulcrumError) -> None:
        for request_id in list(self._streams):
            self._deliver_error(request_id, exc)
            if not isinstance(exc, ModelError):  # the engine still runs: free the blocks
                self._submit(request_id)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()

    # --- supervision (event loop) ---------------------------------------------------------

    def _on_crash(self, exc: BaseException) -> None:
        """The engine thread died: fail its requests, then restart it after a backoff."""
        self._fail_all(ModelError(f"LLM engine crashed ({exc!r}); it is being restarted"))
        if self._stopping or not self._accepting:
            return
        backoff_s = self._restarts.on_crash(self.engine.clock.now())
        if backoff_s is None:
            log.error("LLM engine %r crashed too often; it stays down", self.model_name)
            self._given_up = True
            return
        self._retry_after_s = max(backoff_s, 1.0)
        # Owned here: stop() cancels it; it ends by starting a thread or by giving up.
        self._restart_task = asyncio.get_running_loop().create_task(self._restart(backoff_s))

    async def _restart(self, backoff_s: float) -> None:
        await asyncio.sleep(backoff_s)  # the backoff deadline; nothing to wait on instead
        thread = self._thread
        if thread is not None:  # it ended with the crash; join so no two threads overlap
            await asyncio.to_thread(thread.join)
        if self._stopping or not self._accepting:
            return
        with self._lock:  # their streams were failed at the crash: they must not run now
            self._commands = [c for c in self._commands if isinstance(c, str)]
        self._reset_pending = True
        self._num_waiting = 0  # the reset empties the queue; the new thread publishes anew
        self._error = None
        self._restarts.on_restart(self.engine.clock.now())
        if self.engine.metrics is not None:
            self.engine.metrics.restarts.inc()
        log.warning("LLM engine %r restarted (restart %d)", self.model_name, self.num_restarts)
        self._thread = threading.Thread(
            target=self._run, name=f"llm-engine-{self.model_name}", daemon=True
        )
        self._thread.start()

    async def _cancel_restart(self) -> None:
        task, self._restart_task = self._restart_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _down_error(self) -> Unavailable:
        name = self.model_name
        if self._given_up:
            return Unavailable(
                f"model {name!r}: the LLM engine crashed repeatedly and stays down; reload it"
            )
        if self._error is not None:
            return Unavailable(
                f"model {name!r}: the LLM engine is restarting after a crash",
                retry_after_s=self._retry_after_s,
            )
        return Unavailable(f"model {name!r}: the LLM engine is not running")
