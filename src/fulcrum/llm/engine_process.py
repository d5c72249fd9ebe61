"""The server's side of an engine process (`engine_process = true`): spawns it ("spawn", never
fork: the server has threads and torch), waits for it to load, and talks over one duplex pipe.
A sender thread batches the loop's commands into one message; a reader thread turns each step's
token ids into text (`engine_outputs`), hands the outputs to the loop with one
`call_soon_threadsafe`, and replays the step's metrics. A dead process (killed, exited, a failed
step) is reported as a crash naming its pid and exit status; one that holds requests but sends
no step for engine_step_timeout_s is killed and reported as stalled. A client never stopped is
stopped at interpreter exit (or when collected), so its process never holds the exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.util import Finalize
from pathlib import Path

from fulcrum.errors import ModelError
from fulcrum.llm.chat import ChatTemplate
from fulcrum.llm.engine_client import AddRequest, Command, EngineSink, call_in_loop
from fulcrum.llm.engine_core import CommandBatch, Fatal, Ready, StepReport, StopRequest, serve
from fulcrum.llm.engine_front import EngineFront, load_tokenizer
from fulcrum.llm.engine_outputs import OutputProcessor
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.params import EngineParams

log = logging.getLogger(__name__)
_CONTEXT = multiprocessing.get_context("spawn")
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
# One start at a time: _passive_omp sets the environment the child inherits for the length of a
# start, so two at once (an engine group loading, restarts) could start one without it.
_START_LOCK = threading.Lock()
# A client never stopped is stopped this long after interpreter exit begins (then killed).
EXIT_STOP_TIMEOUT_S = 2.0
# Runs before multiprocessing's own exit handler, which SIGTERMs daemon children and then joins
# them: the engine process ignores SIGTERM (the server drains it), so that join never ended.
_EXIT_PRIORITY = 10


class EngineProcessDied(ModelError):
    """The engine process ended without being asked to."""


class EngineProcessStalled(EngineProcessDied):
    """The engine process had requests but sent no step for engine_step_timeout_s: killed."""


class _Generation:
    """One engine process and the two threads that talk to it."""

    def __init__(self, process: BaseProcess, conn: Connection, ready: Ready) -> None:
        self.process = process
        self.conn = conn
        self.ready = ready
        self.commands: CommandBatch = []
        self.wake = threading.Condition()
        self.num_sent = 0  # commands handed to the sender, numbered as the process counts them
        self.pending: deque[tuple[int, int]] = deque()  # adds not yet applied: (number, tokens)
        self.closed = False  # no more commands: shutdown sent, or the process is gone
        self.fatal: str | None = None  # what the process said before it exited
        self.stalled_s: float | None = None  # killed after no step for this long
        self.reader: threading.Thread | None = None
        self.sender: threading.Thread | None = None


class ProcessEngineClient:
    """An `EngineClient` whose engine runs in a child process; `front` admits requests here."""

    crash_is_model_error = False  # the process is gone with every request: 503 while restarting

    def __init__(
        self,
        version_dir: Path,
        params: EngineParams,
        model_name: str,
        metrics: LLMMetrics,
        *,
        target: Callable[[Connection, str, EngineParams], None] = serve,
    ) -> None:
        """Start the process and wait until it loaded the weights (blocking: a worker thread).
        target: the process's entry point (a test's fault-injecting wrapper of `serve`)."""
        self._target = target
        self.version_dir = version_dir
        self.params = params
        self.model_name = model_name
        self.metrics = metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sink: EngineSink | None = None
        self._life = threading.Lock()  # one spawn or stop at a time
        self._stopping = False
        # The current generation, in a box the exit finalizer shares without holding self.
        self._current = [self._spawn()]
        try:
            self.front = self._front(self._gen.ready)
        except BaseException:  # no tokenizer, say: the loaded process must not outlive us
            self._shutdown(self._gen)
            self._end(self._gen, 5.0)
            raise
        # Text and stop strings of the requests in flight, off the stepping process.
        self.outputs = OutputProcessor(self.front.tokenizer)
        args = (weakref.ref(self), self._current)
        Finalize(self, _stop_at_exit, args=args, exitpriority=_EXIT_PRIORITY)

    def _front(self, ready: Ready) -> EngineFront:
        params = self.params
        return EngineFront(
            load_tokenizer(self.version_dir),
            ChatTemplate(
                ready.chat_template,
                ready.special_tokens,
                trust_request_templates=params.trust_request_chat_template,
            ),
            params,
            vocab_size=ready.vocab_size,
            eos_token_ids=ready.eos_token_ids,
            max_model_len=ready.max_model_len,
            metrics=self.metrics,
        )

    @property
    def _gen(self) -> _Generation:
        return self._current[0]

    @property
    def pid(self) -> int:
        """The engine process's id (a new one after each restart)."""
        return self._gen.ready.pid

    @property
    def is_alive(self) -> bool:
        gen = self._gen
        return gen.reader is not None and gen.reader.is_alive() and not gen.closed

    def start(self, loop: asyncio.AbstractEventLoop, sink: EngineSink) -> None:
        self._loop, self._sink = loop, sink
        self._start_threads(self._gen)

    def submit(self, command: Command) -> None:
        if isinstance(command, str):  # its later outputs, if any, are dropped
            self.outputs.forget(command)
        self._send(self._gen, command)

    def _send(self, gen: _Generation, command: Command | StopRequest) -> None:
        with gen.wake:
            if gen.closed:
                return  # the process is gone: its crash report fails the request
            gen.num_sent += 1
            if isinstance(command, AddRequest):
                gen.pending.append((gen.num_sent, len(command.token_ids)))
                self.outputs.add(command.request_id, command.sampling, gen.num_sent)
            gen.commands.append(command)
            gen.wake.notify()

    def pending(self) -> tuple[int, int]:
        gen = self._gen
        with gen.wake:
            return len(gen.pending), sum(n for _, n in gen.pending)

    def restart(self) -> None:
        old = self._gen
        self._end(old, timeout_s=1.0)  # it died already: reap it and its threads
        self.outputs.clear()  # failed at the crash; the new process numbers commands anew
        with self._life:
            if self._stopping:
                return
            gen = self._spawn()
            if self.front.max_model_len != gen.ready.max_model_len:  # never: same files
                raise ModelError("the restarted engine process reports another max_model_len")
            self._current[0] = gen
            self._start_threads(gen)

    def stop(self, timeout_s: float) -> None:
        self._stopping = True
        with self._life:  # a restart under way finishes its spawn first
            gen = self._gen
            self._shutdown(gen)
            self._end(gen, timeout_s)

    # --- process life ---------------------------------------------------------------------

    def _spawn(self) -> _Generation:
        parent_conn, child_conn = _CONTEXT.Pipe(duplex=True)
        process = _CONTEXT.Process(
            target=self._target,
            args=(child_conn, str(self.version_dir), self.params),
            name=f"llm-engine-{self.model_name}",
            daemon=True,  # a server that exits normally takes it along
        )
        with _START_LOCK, _passive_omp():
            process.start()
        # Only the child holds its end now, so its death reads as EOF here.
        child_conn.close()
        try:
            message = parent_conn.recv()
        except EOFError:
            message = None
        if isinstance(message, Ready):
            return _Generation(process, parent_conn, message)
        process.join(5.0)
        parent_conn.close()
        if isinstance(message, Fatal) and message.error is not None:
            raise message.error
        said = message.message if isinstance(message, Fatal) else "no message"
        raise EngineProcessDied(
            f"model {self.model_name!r}: the engine process {_exit_status(process)} while "
            f"loading ({said})"
        )

    def _end(self, gen: _Generation, timeout_s: float) -> None:
        gen.process.join(timeout_s)
        if gen.process.is_alive():  # it did not drain in time
            log.warning("engine process of %r did not stop; killing it", self.model_name)
            gen.process.kill()
            gen.process.join()
        with gen.wake:
            gen.closed = True
            gen.wake.notify()
        for thread in (gen.sender, gen.reader):
            if thread is not None and thread is not threading.current_thread():
                thread.join()
        gen.conn.close()

    def _start_threads(self, gen: _Generation) -> None:
        gen.reader = threading.Thread(
            target=self._read, args=(gen,), name=f"llm-reader-{self.model_name}", daemon=True
        )
        gen.sender = threading.Thread(
            target=self._write, args=(gen,), name=f"llm-sender-{self.model_name}", daemon=True
        )
        gen.reader.start()
        gen.sender.start()

    def _shutdown(self, gen: _Generation) -> None:
        """Ask the process to abort what it holds, report, and exit."""
        if gen.sender is None:  # never started: no sender thread to hand it to
            with contextlib.suppress(OSError):
                gen.conn.send([None])
            return
        with gen.wake:
            if not gen.closed:
                gen.commands.append(None)
                gen.wake.notify()

    # --- threads --------------------------------------------------------------------------

    def _write(self, gen: _Generation) -> None:
        """Sender: every command queued since the last send, as one message."""
        while True:
            with gen.wake:
                while not gen.commands and not gen.closed:
                    gen.wake.wait()
                if gen.closed and not gen.commands:
                    return
                batch, gen.commands = gen.commands, []
            try:
                gen.conn.send(batch)
            except OSError:  # the process is gone; the reader reports it
                return
            if None in batch:
                return

    def _read(self, gen: _Generation) -> None:
        """Reader: each step message to the loop; at EOF, the crash (unless asked to stop)."""
        timeout_s = self.params.engine_step_timeout_s
        try:
            while True:
                if not gen.conn.poll(timeout_s):  # EOF polls True: recv then raises
                    self._check_stall(gen, timeout_s)
                    continue
                message = gen.conn.recv()
                if isinstance(message, StepReport):
                    self._on_report(gen, message)
                elif isinstance(message, Fatal):
                    gen.fatal = message.message
        except (EOFError, OSError):
            pass
        with gen.wake:
            gen.closed = True
            gen.wake.notify()
        if self._stopping or self._sink is None:
            return
        gen.process.join(5.0)  # EOF: it exited or is exiting; its status names the cause
        error = self._death(gen)
        log.error("%s", error)
        call_in_loop(self._loop, self._sink.on_crash, error)

    def _check_stall(self, gen: _Generation, waited_s: float) -> None:
        """No message for waited_s: idle, or hung with requests (then kill it; EOF follows)."""
        if not len(self.outputs) or self._stopping or gen.stalled_s is not None:
            return  # idle: it blocks on the pipe and sends nothing, rightly
        gen.stalled_s = waited_s
        log.error(
            "engine process of %r (pid %d): no step for %g s with %d requests; killing it",
            self.model_name, gen.ready.pid, waited_s, len(self.outputs),
        )  # fmt: skip
        gen.process.kill()

    def _death(self, gen: _Generation) -> EngineProcessDied:
        who = f"model {self.model_name!r}: the LLM engine process (pid {gen.ready.pid})"
        if gen.stalled_s is not None:
            return EngineProcessStalled(
                f"{who} stalled: no step for {gen.stalled_s:g} s (engine_step_timeout_s) with "
                "requests in flight, so it was killed"
            )
        said = f" after {gen.fatal}" if gen.fatal else ""
        return EngineProcessDied(f"{who} {_exit_status(gen.process)}{said}")

    def _on_report(self, gen: _Generation, report: StepReport) -> None:
        with gen.wake:
            while gen.pending and gen.pending[0][0] <= report.num_applied:
                gen.pending.popleft()
        sink = self._sink
        budget = self.front.budget
        if budget is not None and report.budget_state is not None:
            budget.state = report.budget_state  # read by check_admission on the loop
        if report.metrics is not None:
            report.metrics.replay(self.metrics)
        if sink is None:
            return
        sink.set_num_waiting(report.num_waiting)
        for request_id, _ in report.errors:
            self.outputs.forget(request_id)
        if report.outputs or report.errors:
            step = self.outputs.process(report.outputs, report.num_applied)  # not on the loop
            for request_id in step.stopped:
                self._send(gen, StopRequest(request_id))
            for request_id in step.failed:
                self._send(gen, request_id)
            call_in_loop(self._loop, sink.on_step, step.outputs, report.errors)


def _stop_at_exit(ref: weakref.ref[ProcessEngineClient], current: list[_Generation]) -> None:
    """At interpreter exit, or when a client is collected: stop its process unless it was."""
    client = ref()
    if client is not None:
        if not client._stopping:
            client.stop(EXIT_STOP_TIMEOUT_S)
        return
    gen = current[0]  # collected: never started (its threads would hold it), maybe stopped
    if gen.process.is_alive():
        with contextlib.suppress(OSError):
            gen.conn.send([None])
        gen.process.join(EXIT_STOP_TIMEOUT_S)
        if gen.process.is_alive():
            gen.process.kill()
            gen.process.join()
    gen.conn.close()


@contextlib.contextmanager
def _passive_omp() -> Iterator[None]:
    """OpenMP workers that sleep rather than spin between parallel regions, for the process
    started within (the environment it inherits; torch reads it as it loads). Spinning, they
    took the core the server needs: 0.2x the tokens/s served with 2 engine threads on 2 cores.
    A value the user set is kept."""
    if OMP_WAIT_POLICY in os.environ:
        yield
        return
    os.environ[OMP_WAIT_POLICY] = "PASSIVE"
    try:
        yield
    finally:
        os.environ.pop(OMP_WAIT_POLICY, None)


def _exit_status(process: BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"
