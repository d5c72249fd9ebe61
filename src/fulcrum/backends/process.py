"""Process isolation for Python models: each instance runs the user's class in a process of its own.

As Triton's python_backend runs a stub process per instance: the user's code cannot hold the
server's GIL or take the server down with it. Tensors pass through shared memory (`shm.py`); a
process that dies fails the batch it was running and is restarted for the next one, at most
`max_restarts` times within `restart_window_s`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import traceback
from dataclasses import dataclass, field
from multiprocessing import connection, util
from multiprocessing.connection import Connection
from pathlib import Path

from fulcrum import errors
from fulcrum.backends import shm
from fulcrum.backends.python import PythonBackend
from fulcrum.backends.restart_budget import RestartBudget
from fulcrum.config import ModelConfig
from fulcrum.errors import FulcrumError, ModelError, Unavailable
from fulcrum.parameters import PythonParameters, decode_parameters
from fulcrum.types import Clock, MonotonicClock, TensorMap

logger = logging.getLogger(__name__)

# "spawn", never "fork": the server has threads, and a forked child inherits their locks held.
_CONTEXT = multiprocessing.get_context("spawn")
_STOP_TIMEOUT_S = 5.0  # for the user's close() before the process is terminated


# Messages on the pipe. Server -> model process:
@dataclass(frozen=True)
class _Run:
    input_region: str
    output_region: str
    inputs: shm.Layout


@dataclass(frozen=True)
class _Resized:
    output_region: str | None  # None: the server could not grow it


@dataclass(frozen=True)
class _Stop:
    pass


# Model process -> server:
@dataclass(frozen=True)
class _Ready:
    pass


@dataclass(frozen=True)
class _NeedBytes:
    num_bytes: int


@dataclass(frozen=True)
class _Done:
    outputs: shm.Layout


@dataclass(frozen=True)
class _Failed:
    kind: str  # the fulcrum.errors class to raise
    message: str
    trace: str


class _Exited(Exception):
    """The model process is gone (internal: becomes a ModelError naming the exit code)."""

    def __init__(self, exitcode: int | None) -> None:
        super().__init__(exitcode)
        self.exitcode = exitcode


class _Child:
    """One model process and the server's end of its pipe."""

    def __init__(self, config: ModelConfig, version_dir: Path) -> None:
        self.conn, child_conn = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(
            target=_child_main,
            args=(child_conn, config, version_dir),
            name=f"fulcrum-model-{config.name}",
        )
        self.process.start()
        child_conn.close()  # else the child's death would never show here as end-of-file
        self.ready = False

    def send(self, message: object) -> None:
        # A dead child breaks the pipe; `receive` then reports how it exited.
        with contextlib.suppress(OSError):
            self.conn.send(message)

    def receive(self, timeout_s: float | None = None) -> object:
        """The next message; `_Exited` if the process died; TimeoutError after `timeout_s`."""
        ready = connection.wait([self.conn, self.process.sentinel], timeout_s)
        if not ready:
            raise TimeoutError
        if self.conn in ready:  # first: a reply may have come just before the exit
            with contextlib.suppress(EOFError, OSError):
                message: object = self.conn.recv()
                return message
        raise _Exited(self._reap())

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        self.process.kill()
        self._reap()

    def stop(self) -> None:
        """Ask the process to close the model and exit; terminate it if it does not."""
        self.send(_Stop())
        self._reap()

    def _reap(self) -> int | None:
        # Wait first: end-of-file can show a moment before the exit status does.
        self.process.join(_STOP_TIMEOUT_S)
        for end in (self.process.terminate, self.process.kill):
            if self.process.exitcode is not None:
                break
            end()
            self.process.join(_STOP_TIMEOUT_S)
        self.conn.close()
        return self.process.exitcode


@dataclass
class _State:
    """What the finalizer releases, also when the backend is dropped without `close`."""

    inputs: shm.Region = field(default_factory=shm.Region)
    outputs: shm.Region = field(default_factory=shm.Region)
    child: _Child | None = None


def _shutdown(state: _State) -> None:
    if state.child is not None:
        state.child.stop()
        state.child = None
    state.inputs.close()
    state.outputs.close()


class ProcessBackend:
    """Forwards each batch to the model's own process; a `Backend` like `PythonBackend`."""

    def __init__(
        self, config: ModelConfig, version_dir: Path, *, clock: Clock | None = None
    ) -> None:
        params = decode_parameters(dict(config.parameters), PythonParameters)
        self.name = config.name
        self._config = config
        self._version_dir = version_dir
        self._start_timeout_s = params.process_start_timeout_s
        # 0: none. A hung thread cannot be stopped; a hung process can be killed and replaced.
        self._execute_timeout_s = params.execute_timeout_s or None
        self._budget = RestartBudget(
            params.max_restarts,
            params.restart_window_s,
            clock or MonotonicClock(),
        )
        self._closed = False
        self._state = _State()
        # Runs on close, on garbage collection, or at interpreter exit before multiprocessing
        # joins its children (exitpriority), so no segment or process outlives the server.
        self._finalizer = util.Finalize(self, _shutdown, args=(self._state,), exitpriority=10)
        try:
            self._state.child = _Child(config, version_dir)
            self._await_ready(self._state.child, "while loading")
        except BaseException:
            self._finalizer()
            raise

    @property
    def pid(self) -> int | None:
        """The model process's id (None while none runs)."""
        child = self._state.child
        return child.process.pid if child is not None else None

    @property
    def num_restarts(self) -> int:
        return self._budget.num_crashes

    def execute(self, inputs: TensorMap) -> TensorMap:
        child = self._ready_child()
        state = self._state
        layout = shm.plan(inputs)
        state.inputs.ensure(layout.num_bytes)
        shm.write(state.inputs.buf, layout, inputs)
        child.send(_Run(state.inputs.name, state.outputs.name, layout))
        try:
            while True:
                reply = child.receive(self._execute_timeout_s)
                if isinstance(reply, _NeedBytes):
                    child.send(_Resized(self._grow_outputs(reply.num_bytes)))
                elif isinstance(reply, _Done):
                    return shm.read(state.outputs.buf, reply.outputs)
                else:
                    raise _error_from(reply)
        except _Exited as exc:
            raise self._crashed(f"{_describe(exc.exitcode)} while running a batch") from None
        except TimeoutError:
            child.kill()
            raise self._crashed(
                f"model process did not finish a batch within {self._execute_timeout_s:g} s; "
                "killed it"
            ) from None

    def close(self) -> None:
        """Stop the model process (the user's `close` runs there) and unlink the segments."""
        self._closed = True
        self._finalizer()

    def _grow_outputs(self, num_bytes: int) -> str | None:
        """The output region's name once it holds `num_bytes`; None (logged) if it cannot."""
        try:
            self._state.outputs.ensure(num_bytes)
        except ModelError as exc:
            logger.warning("model %r: %s", self.name, exc.message)
            return None
        return self._state.outputs.name

    def _ready_child(self) -> _Child:
        if self._closed:
            raise Unavailable(f"model {self.name!r} is closed")
        child = self._state.child
        if child is not None and child.ready and not child.is_alive():
            # Died between batches: this batch runs on the replacement.
            self._crashed(f"{_describe(child.process.exitcode)} while idle")
            child = self._state.child
        if child is None:
            if not self._budget.allows_restart():
                raise Unavailable(
                    f"model {self.name!r}: its process crashed more than "
                    f"{self._budget.max_restarts} times in {self._budget.window_s:g} s; "
                    "not restarted yet",
                    retry_after_s=self._budget.retry_after_s(),
                )
            child = self._state.child = _Child(self._config, self._version_dir)
        if not child.ready:
            try:
                self._await_ready(child, "while restarting")
            except FulcrumError as exc:
                raise self._crashed(f"model process failed to restart ({exc.message})") from None
        return child

    def _await_ready(self, child: _Child, when: str) -> None:
        try:
            reply = child.receive(self._start_timeout_s)
        except TimeoutError:
            child.stop()
            raise ModelError(
                f"model {self.name!r}: model process did not start within "
                f"{self._start_timeout_s:g} s"
            ) from None
        except _Exited as exc:
            raise ModelError(f"model {self.name!r}: {_describe(exc.exitcode)} {when}") from None
        if not isinstance(reply, _Ready):
            child.stop()
            raise _error_from(reply)  # the load error as the user's code raised it
        child.ready = True

    def _crashed(self, what: str) -> ModelError:
        """Record a crash, start the replacement now (it loads while idle), describe it."""
        old = self._state.child
        self._state.child = None
        if old is not None:
            old.stop()
        self._budget.record_crash()
        message = f"model {self.name!r}: {what}"
        restart = not self._closed and self._budget.allows_restart()
        logger.warning("%s; %s", message, "restarting it" if restart else "not restarting it")
        if restart:
            self._state.child = _Child(self._config, self._version_dir)
        return ModelError(message)


def _describe(exitcode: int | None) -> str:
    """`model process exited with code N`, naming the signal when one killed it."""
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"model process exited with code {exitcode} ({signal.Signals(-exitcode).name})"
    return f"model process exited with code {exitcode}"


def _error_from(reply: object) -> FulcrumError:
    if not isinstance(reply, _Failed):
        return ModelError(f"unexpected message from a model process: {type(reply).__name__}")
    if reply.trace:
        logger.debug("model process traceback:\n%s", reply.trace)
    cls = getattr(errors, reply.kind, ModelError)
    if not (isinstance(cls, type) and issubclass(cls, FulcrumError)):
        cls = ModelError
    return cls(reply.message)


# --- in the model process ---


def _child_main(conn: Connection, config: ModelConfig, version_dir: Path) -> None:
    # Ctrl-C reaches the whole process group; the server decides when this process stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        backend = PythonBackend(config, version_dir)
    except Exception as exc:
        conn.send(_failure(exc))
        return
    conn.send(_Ready())
    segments = shm.Attachments()
    try:
        _serve(conn, backend, segments)
    finally:
        segments.close()
        with contextlib.suppress(FulcrumError):
            backend.close()


def _serve(conn: Connection, backend: PythonBackend, segments: shm.Attachments) -> None:
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return  # the server is gone
        if not isinstance(message, _Run):
            return
        segments.keep_only((message.input_region, message.output_region))
        reply = _run(conn, backend, segments, message)
        try:
            conn.send(reply)
        except Exception as exc:  # pickling a BYTES output failed; nothing was sent
            conn.send(_failure(ModelError(f"model {backend.name!r}: output not sendable: {exc}")))


def _run(
    conn: Connection, backend: PythonBackend, segments: shm.Attachments, message: _Run
) -> _Done | _Failed:
    inputs = shm.read(segments.get(message.input_region), message.inputs)
    try:
        outputs = backend.execute(inputs)
    except Exception as exc:
        return _failure(exc)
    layout = shm.plan(outputs)
    region = message.output_region
    if layout.num_bytes > len(segments.get(region)):
        conn.send(_NeedBytes(layout.num_bytes))
        resized = conn.recv()
        assert isinstance(resized, _Resized), resized
        if resized.output_region is None:
            text = (
                f"model {backend.name!r}: outputs of {layout.num_bytes} bytes found no room in "
                "shared memory (/dev/shm)"
            )
            return _Failed("ModelError", text, "")
        region = resized.output_region
        segments.keep_only((message.input_region, region))
    shm.write(segments.get(region), layout, outputs)
    return _Done(layout)


def _failure(exc: Exception) -> _Failed:
    """The error to raise in the server: the nearest fulcrum.errors class, else ModelError."""
    trace = "".join(traceback.format_exception(exc))
    if isinstance(exc, FulcrumError):
        kind = next(c.__name__ for c in type(exc).__mro__ if c.__module__ == errors.__name__)
        return _Failed(kind, exc.message, trace)
    return _Failed("ModelError", f"model process failed: {exc!r}", trace)
