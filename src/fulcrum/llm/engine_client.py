"""The seam between `AsyncLLMEngine` (admission and streams, on the event loop) and whatever
steps its `LLMEngine`: a thread of the server (`engine_thread`) or a process of its own
(`engine_process`). Both take commands from the loop and hand each step's outputs back to it
with one `call_soon_threadsafe` per step."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from fulcrum.errors import FulcrumError
from fulcrum.llm.outputs import RequestOutput
from fulcrum.llm.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class AddRequest:
    """A request handed from the event loop to the engine."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_s: float


Command = AddRequest | str  # str: the id of a request to abort


class EngineSink(Protocol):
    """What a client reports to; `on_step` and `on_crash` run on the event loop."""

    def on_step(self, outputs: list[RequestOutput], errors: list[tuple[str, FulcrumError]]) -> None:
        """A step's outputs, and requests the engine refused when it took them (errors)."""

    def on_crash(self, exc: BaseException) -> None:
        """The stepping thread or process died: every request it held is lost."""

    def set_num_waiting(self, num_waiting: int) -> None:
        """The scheduler's waiting count, as last published (any thread calls it)."""


class EngineClient(Protocol):
    """Steps one model's engine somewhere; every method is called from the event loop's thread
    (start, restart and stop may block: the loop calls those in a worker thread)."""

    @property
    def is_alive(self) -> bool:
        """True while the thread or process steps (False after a crash, before a restart)."""

    @property
    def crash_is_model_error(self) -> bool:
        """True when a crash keeps no state of the requests (a thread: failed as ModelError);
        False when the engine is gone and restarting is what the client waits for (503)."""

    def start(self, loop: asyncio.AbstractEventLoop, sink: EngineSink) -> None:
        """Begin stepping; reports go to sink on loop."""

    def submit(self, command: Command) -> None:
        """Queue a command for the engine's next step."""

    def pending(self) -> tuple[int, int]:
        """Adds not yet taken by the engine: (requests, prompt tokens), for admission."""

    def restart(self) -> None:
        """After a crash: a fresh engine state (pending adds dropped, aborts kept). Blocking."""

    def stop(self, timeout_s: float) -> None:
        """End stepping (in-flight requests aborted, blocks freed) within timeout_s. Blocking."""


def call_in_loop(
    loop: asyncio.AbstractEventLoop | None, callback: Callable[..., object], *args: object
) -> None:
    """Run callback(*args) on loop from another thread; nothing if the loop is gone."""
    if loop is None or loop.is_closed():
        return
    # RuntimeError: the loop closed meanwhile, so nobody is left to tell.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)
