"""The engine process (vLLM V1's EngineCore process): loads the weights, then steps its LLMEngine,
taking the server's commands from one duplex pipe and answering with one message per step.
It blocks on the pipe while idle (never polls), takes every pending command before each step,
and exits when the server's end of the pipe closes (the server died: never an orphan)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from fulcrum.errors import FulcrumError
from fulcrum.llm.budget import BudgetState
from fulcrum.llm.engine_client import AddRequest
from fulcrum.llm.engine_thread import add_to
from fulcrum.llm.metrics_relay import MetricEvents, RecordingMetrics
from fulcrum.llm.outputs import OutputRow, RequestOutput, pack_outputs
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sync_engine import LLMEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StopRequest:
    """The server found a stop string in this request's text: finish it as "stop"."""

    request_id: str


# One message from the server: the commands queued since its last one; str: abort; None: shut
# down.
CommandBatch = list[AddRequest | StopRequest | str | None]


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine loaded: what the server's front needs to admit requests without weights."""

    pid: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    special_tokens: dict[str, str]


@dataclass(frozen=True, slots=True)
class StepReport:
    """One step (or one batch of commands) done: its outputs and the state admission reads."""

    outputs: list[OutputRow]  # fulcrum.llm.outputs.unpack_outputs makes them RequestOutputs
    errors: list[tuple[str, FulcrumError]]  # adds the engine refused (QueueFull, InvalidInput)
    num_applied: int  # commands taken since the process started: the server's pending adds
    num_waiting: int
    budget_state: BudgetState | None
    metrics: MetricEvents | None


@dataclass(frozen=True, slots=True)
class Fatal:
    """The engine cannot go on (a failed load, a step that raised); the process exits next."""

    message: str
    error: FulcrumError | None = None  # a load's ConfigError, re-raised as is by the server


def serve(conn: Connection, version_dir: str, params: EngineParams) -> None:
    """The process's entry point (multiprocessing "spawn" target)."""
    # Ctrl-C (and a container's SIGTERM) reach every process: the server drains, then stops
    # this one itself (or it reads EOF when the server is gone).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    metrics = RecordingMetrics()
    params = dataclasses.replace(params, num_threads=child_num_threads(params.num_threads))
    try:
        # Token ids only: the server detokenises and looks for stop strings (engine_outputs).
        engine = LLMEngine.from_checkpoint(
            Path(version_dir), params, metrics=metrics, detokenize=False
        )
    except Exception as exc:
        error = exc if isinstance(exc, FulcrumError) else None
        _send_quietly(conn, Fatal(f"loading the model failed: {exc!r}", error))
        sys.exit(1)
    # The startup heap (model, tokenizer, grammar compiler) lives as long as the process:
    # frozen, as vLLM V1's engine core does, the collector never walks it again. Measured: about
    # 8% less CPU per saturated decode step (256 sequences, the tiny Llama, 1 thread).
    gc.collect()
    gc.freeze()
    try:
        conn.send(_ready(engine))
        EngineCore(engine, metrics, conn).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the server is gone: nobody to serve
    except Exception as exc:
        log.exception("LLM engine process %d: a step failed", os.getpid())
        _send_quietly(conn, Fatal(f"a step failed: {exc!r}"))
        sys.exit(1)
    # Stopped (its last report sent) or orphaned: nothing is left to clean up, and the
    # interpreter's teardown of torch takes most of a second of the server's drain timeout.
    sys.stderr.flush()
    os._exit(0)


def child_num_threads(num_threads: int) -> int:
    """The engine process's torch threads: as set, or (0) one per core but one, which the
    server keeps: measured on 2 cores, 2 threads beside a busy server gave 0.2x the tokens/s
    of 1 (torch's workers spin while they wait, taking the core the server needs)."""
    if num_threads:
        return num_threads
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _ready(engine: LLMEngine) -> Ready:
    return Ready(
        pid=os.getpid(),
        vocab_size=engine.vocab_size,
        max_model_len=engine.max_model_len,
        eos_token_ids=engine.eos_token_ids,
        chat_template=engine.chat_template,
        special_tokens=dict(engine.special_tokens),
    )


def _send_quietly(conn: Connection, message: Fatal) -> None:
    try:
        conn.send(message)
    except Exception:  # the error does not pickle (or the server is gone: this fails too)
        with contextlib.suppress(OSError):
            conn.send(Fatal(message.message))


class EngineCore:
    """The step loop of the engine process."""

    def __init__(self, engine: LLMEngine, metrics: RecordingMetrics, conn: Connection) -> None:
        self.engine = engine
        self.metrics = metrics
        self.conn = conn
        self.num_applied = 0
        self.stopping = False

    def run(self) -> None:
        """Step until told to stop; EOFError when the server's end of the pipe closes."""
        engine = self.engine
        while not self.stopping:
            # Idle: block on the pipe. Busy: take whatever arrived, without waiting.
            batches = [] if engine.has_unfinished() else [self.conn.recv()]
            while self.conn.poll():
                batches.append(self.conn.recv())
            errors = [e for batch in batches for e in self._apply(batch)]
            outputs = engine.step() if engine.has_unfinished() and not self.stopping else []
            self._report(outputs, errors)
        engine.abort_all()  # the server failed their streams already; count them, free blocks
        self._report([], [])

    def _apply(self, batch: CommandBatch) -> list[tuple[str, FulcrumError]]:
        errors: list[tuple[str, FulcrumError]] = []
        for command in batch:
            self.num_applied += 1
            if command is None:
                self.stopping = True
            elif isinstance(command, str):
                self.engine.abort(command)
            elif isinstance(command, StopRequest):
                self.engine.finish_stopped(command.request_id)
            else:
                try:
                    add_to(self.engine, command)
                except FulcrumError as exc:  # QueueFull or InvalidInput: only this request
                    errors.append((command.request_id, exc))
        return errors

    def _report(self, outputs: list[RequestOutput], errors: list[tuple[str, FulcrumError]]) -> None:
        engine = self.engine
        self.conn.send(
            StepReport(
                outputs=pack_outputs(outputs),
                errors=errors,
                num_applied=self.num_applied,
                num_waiting=engine.num_waiting,
                budget_state=None if engine.budget is None else engine.budget.state,
                metrics=self.metrics.take(),
            )
        )
