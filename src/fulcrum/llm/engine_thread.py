"""The engine stepped by ONE dedicated thread of the server (the default): it sleeps on an event
while idle (never polls), takes every queued command before each step, and after a crash
resets the engine's request state on its next start, reusing the loaded weights."""

from __future__ import annotations

import asyncio
import logging
import threading

from fulcrum.errors import FulcrumError
from fulcrum.llm.engine_client import AddRequest, Command, EngineSink, call_in_loop
from fulcrum.llm.outputs import RequestOutput
from fulcrum.llm.sync_engine import LLMEngine

log = logging.getLogger(__name__)


class ThreadEngineClient:
    """An `EngineClient` that steps `engine` on a thread named `llm-engine-<model>`."""

    crash_is_model_error = True  # the weights stay: a restart only resets the request state

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._commands: list[Command] = []
        self._lock = threading.Lock()  # guards _commands
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sink: EngineSink | None = None
        self._stopping = False
        self._crashed = False
        self._reset_pending = False  # the next thread resets the crashed engine first

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._crashed

    def start(self, loop: asyncio.AbstractEventLoop, sink: EngineSink) -> None:
        self._loop, self._sink = loop, sink
        self._start_thread()

    def submit(self, command: Command) -> None:
        with self._lock:
            self._commands.append(command)
        self._wake.set()

    def pending(self) -> tuple[int, int]:
        with self._lock:
            adds = [c for c in self._commands if isinstance(c, AddRequest)]
        return len(adds), sum(len(c.token_ids) for c in adds)

    def restart(self) -> None:
        thread = self._thread
        if thread is not None:  # it ended with the crash; join so no two threads overlap
            thread.join()
        with self._lock:  # their streams were failed at the crash: they must not run now
            self._commands = [c for c in self._commands if isinstance(c, str)]
        self._reset_pending = True
        self._crashed = False
        self._start_thread()

    def stop(self, timeout_s: float) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _start_thread(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"llm-engine-{self.model_name}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        engine = self.engine
        try:
            if self._reset_pending:  # here, not on the loop: a reset frees and rebuilds state
                self._reset_pending = False
                engine.reset()
            while not self._stopping:
                self._wake.clear()
                self._apply_commands()
                if not engine.has_unfinished():
                    self._wake.wait()
                    continue
                outputs = engine.step()
                self._publish_waiting()
                if outputs:
                    self._report(outputs, [])
            self._apply_commands()
            engine.abort_all()  # stop() already failed their streams; free the blocks
        except BaseException as exc:
            log.exception("LLM engine %r died", self.model_name)
            self._crashed = True
            if self._sink is not None:
                call_in_loop(self._loop, self._sink.on_crash, exc)

    def _apply_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        errors: list[tuple[str, FulcrumError]] = []
        for command in commands:
            if isinstance(command, str):
                self.engine.abort(command)
                continue
            try:
                add_to(self.engine, command)
            except FulcrumError as exc:  # QueueFull or InvalidInput: fails only this request
                errors.append((command.request_id, exc))
        if errors:
            self._report([], errors)
        self._publish_waiting()

    def _publish_waiting(self) -> None:
        if self._sink is not None:
            self._sink.set_num_waiting(self.engine.num_waiting)

    def _report(self, outputs: list[RequestOutput], errors: list[tuple[str, FulcrumError]]) -> None:
        if self._sink is not None:
            call_in_loop(self._loop, self._sink.on_step, outputs, errors)


def add_to(engine: LLMEngine, command: AddRequest) -> None:
    """Queue an admitted request on the engine (already checked, so no second SLO check)."""
    engine.add_request(
        command.request_id,
        command.token_ids,
        command.sampling,
        priority=command.priority,
        cache_salt=command.cache_salt,
        arrival_s=command.arrival_s,
        check_slo=False,  # checked at admission; the queue ahead is not its fault
    )
