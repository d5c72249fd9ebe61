"""AsyncLLMEngine: the step loop on ONE dedicated thread, tokens handed to each request's asyncio
queue with `call_soon_threadsafe`. The thread sleeps on an event while idle (never polls); a
cancelled stream aborts its sequence within a step; a dead engine fails every request clearly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fulcrum.errors import FulcrumError, InvalidInput, ModelError, QueueFull, Unavailable
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.outputs import RequestOutput
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sync_engine import LLMEngine

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from fulcrum.config import ModelConfig

__all__ = ["AsyncLLMEngine", "LLMEngine"]

log = logging.getLogger(__name__)
_Item = RequestOutput | BaseException


class _Add:
    """A request handed from the event loop to the engine thread."""

    def __init__(
        self,
        request_id: str,
        token_ids: list[int],
        sampling: SamplingParams,
        priority: int,
        cache_salt: str | None,
        arrival_s: float,
    ) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.sampling = sampling
        self.priority = priority
        self.cache_salt = cache_salt
        self.arrival_s = arrival_s


class AsyncLLMEngine:
    """One model's engine for the server: `generate` streams RequestOutputs."""

    def __init__(self, engine: LLMEngine, *, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
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
        self._idle = asyncio.Event()

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        version_dir: Path,
        *,
        registry: CollectorRegistry | None = None,
    ) -> AsyncLLMEngine:
        """Build from a `platform = "llm"` model: parameters from config.toml, weights from disk."""
        from prometheus_client import CollectorRegistry

        params = EngineParams.from_parameters(dict(config.parameters))
        metrics = LLMMetrics(registry or CollectorRegistry(), config.name)
        engine = LLMEngine.from_checkpoint(version_dir, params, metrics=metrics)
        return cls(engine, model_name=config.name)

    @property
    def is_healthy(self) -> bool:
        """False once the engine thread died (readiness goes off) or before start."""
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def encode(self, text: str) -> list[int]:
        """Token ids of a text prompt."""
        return self.engine.encode(text)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for chat messages (the checkpoint's template, or a default)."""
        return self.engine.apply_chat_template(messages)

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
        """Refuse new requests, let in-flight ones finish (bounded), abort the rest, join."""
        self._accepting = False
        drain_s = self.engine.params.drain_timeout_s if timeout_s is None else timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), drain_s)
        self._fail_all(Unavailable(f"model {self.model_name!r} is shutting down"))
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, max(drain_s, 1.0))

    def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Admit a request now (raising InvalidInput, QueueFull or Unavailable at the call) and
        stream its outputs; closing or cancelling the iterator aborts the request."""
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
        if self._error is not None or not self.is_healthy:
            raise Unavailable(f"model {self.model_name!r}: the LLM engine is not running")
        if not self._accepting:
            raise Unavailable(f"model {self.model_name!r} is shutting down")
        if request_id in self._streams:
            raise InvalidInput(f"request id {request_id!r} is already in use")
        token_ids = self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
        # Validate here, before queueing, so a bad request fails alone and at once.
        self.engine.check_request(token_ids, sampling)
        with self._lock:
            num_pending = sum(isinstance(c, _Add) for c in self._commands)
        max_waiting = self.engine.params.max_num_waiting
        if self._num_waiting + num_pending >= max_waiting:
            raise QueueFull(f"model {self.model_name!r}: {max_waiting} requests already waiting")
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
            self._call_in_loop(self._fail_all, ModelError(f"LLM engine died: {exc!r}"))

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
