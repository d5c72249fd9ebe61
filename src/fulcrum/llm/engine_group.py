"""Data-parallel engine processes (`num_engine_processes = N`, vLLM's data_parallel_size): N
`ProcessEngineClient`s behind one `EngineClient`, so `AsyncLLMEngine` runs unchanged. Each process
is a whole engine (weights, KV pool, scheduler, torch threads). A new request goes to the process
`engine_router` picks, an abort to the process holding the request. A process that dies fails
only its own requests (503) and is restarted with backoff while the others serve; when none is
left the model goes down and its supervisor restarts the group, as with one engine process."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TypeVar

from fulcrum.errors import ConfigError, FulcrumError, ModelError, Unavailable
from fulcrum.lifecycle.memory import MIB, process_rss_bytes
from fulcrum.llm.engine_client import Command, EngineSink, call_in_loop
from fulcrum.llm.engine_core import serve
from fulcrum.llm.engine_front import EngineFront
from fulcrum.llm.engine_group_metrics import ChildMetrics, GaugeTable
from fulcrum.llm.engine_process import ProcessEngineClient
from fulcrum.llm.engine_router import ChildLoad, Router, affinity_slack, least_loaded
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.outputs import RequestOutput
from fulcrum.llm.params import EngineParams
from fulcrum.llm.supervisor import RestartPolicy, RestartTracker
from fulcrum.tuning.resources import usable_cores

log = logging.getLogger(__name__)
KEY = "parameters.num_engine_processes"
T = TypeVar("T")


def threads_per_process(num_threads: int, num_processes: int, num_cores: int) -> int:
    """Each engine process's torch threads: as set, or (0) the cores but one (the server's)
    shared out, at least one each; 1 each on 2 cores (see README: measured)."""
    if num_threads:
        return num_threads
    return max(1, (num_cores - 1) // num_processes)


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_cores(num_processes: int, num_cores: int) -> None:
    """ConfigError naming the key: each process steps on a core of its own."""
    if num_processes > num_cores:
        raise ConfigError(
            f"key '{KEY}' = {num_processes}: more engine processes than the {num_cores} CPU "
            "cores this server may use"
        )


def check_memory(num_processes: int, rss_bytes: int | None, available_bytes: int | None) -> None:
    """ConfigError naming the key when the processes still to start (each the size the first
    one is, loaded) need more than the memory available; nothing when either is unknown."""
    if rss_bytes is None or available_bytes is None:
        return
    needed_bytes = (num_processes - 1) * rss_bytes
    if needed_bytes > available_bytes:
        raise ConfigError(
            f"key '{KEY}' = {num_processes}: each engine process holds about "
            f"{rss_bytes / MIB:.0f} MiB once loaded; the other {num_processes - 1} need "
            f"{needed_bytes / MIB:.0f} MiB, more than the {available_bytes / MIB:.0f} MiB "
            "available"
        )


class EngineGroupClient:
    """An `EngineClient` over N engine processes; `front` admits requests for all of them."""

    crash_is_model_error = False  # a process is gone with its requests: 503, it restarts

    def __init__(
        self,
        version_dir: Path,
        params: EngineParams,
        model_name: str,
        metrics: LLMMetrics,
        *,
        restart_policy: RestartPolicy | None = None,
        target: Callable[[Connection, str, EngineParams], None] = serve,
        num_cores: int | None = None,
        available_bytes: Callable[[], int | None] = available_memory_bytes,
    ) -> None:
        """Start the processes and wait until each loaded the weights (blocking: a worker
        thread): the first alone (a bad checkpoint fails once), then the rest at once.
        target: each process's entry point (a test's fault-injecting wrapper of `serve`)."""
        num = params.num_engine_processes
        cores = num_cores or usable_cores()
        check_cores(num, cores)
        threads = threads_per_process(params.num_threads, num, cores)
        if num * threads > cores:
            log.warning("model %r: %d engine processes x %d torch threads on %d cores",
                        model_name, num, threads, cores)  # fmt: skip
        self.model_name = model_name
        self.metrics = metrics
        self._gauges = GaugeTable(metrics, num)
        child_params = dataclasses.replace(params, num_threads=threads)

        def load(index: int) -> ProcessEngineClient:
            child_metrics = ChildMetrics(metrics, self._gauges, index)
            return ProcessEngineClient(
                version_dir, child_params, model_name, child_metrics, target=target
            )

        self.children = _load_all(load, num, available_bytes)
        head = self.children[0].front
        # The server's side of every process: one tokenizer and chat template, shared.
        self.front = EngineFront(head.tokenizer, head.chat, params, vocab_size=head.vocab_size,
                                 eos_token_ids=head.eos_token_ids,
                                 max_model_len=head.max_model_len, metrics=metrics)  # fmt: skip
        self._router = Router(params.block_size, affinity_slack(params.max_num_seqs))
        # Loop-only state: who holds each request in flight, and how much each process holds.
        self._owners: dict[str, tuple[int, int]] = {}  # request id -> (process, prompt tokens)
        self._num_requests = [0] * num
        self._num_tokens = [0] * num
        self._waiting = [0] * num  # each process's scheduler queue, as it last published it
        self._waiting_lock = threading.Lock()  # the reader threads publish
        self._trackers = [RestartTracker(restart_policy or RestartPolicy()) for _ in range(num)]
        self._restart_locks = [threading.Lock() for _ in range(num)]
        self._tasks: set[asyncio.Task[None]] = set()  # pending restarts of single processes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sink: EngineSink | None = None
        self._stopping = False
        # Single processes restarted while the others served (the group's own restarts, with
        # every process down, are the model's: AsyncLLMEngine counts those).
        self.num_restarts = 0

    @property
    def pids(self) -> tuple[int, ...]:
        """The engine processes' ids (new ones after restarts): the memory budget counts their
        resident memory, and keeps its last figure while one cannot be read (restarting)."""
        return tuple(child.pid for child in self.children)

    @property
    def is_alive(self) -> bool:
        """True while any process steps: the others serve while one restarts."""
        return any(child.is_alive for child in self.children)

    def loads(self) -> list[ChildLoad | None]:
        """Each process's outstanding requests and prompt tokens; None: down."""
        return [
            ChildLoad(self._num_requests[i], self._num_tokens[i]) if child.is_alive else None
            for i, child in enumerate(self.children)
        ]

    def owner(self, request_id: str) -> int | None:
        """The process holding a request in flight."""
        owner = self._owners.get(request_id)
        return None if owner is None else owner[0]

    def start(self, loop: asyncio.AbstractEventLoop, sink: EngineSink) -> None:
        self._loop, self._sink = loop, sink
        for index, child in enumerate(self.children):
            child.start(loop, _ChildSink(self, index))

    def submit(self, command: Command) -> None:
        if isinstance(command, str):  # an abort: to the process holding it, if any
            owner = self._owners.pop(command, None)
            if owner is not None:
                self._unload(*owner)
                self.children[owner[0]].submit(command)
            return
        index = self._router.route(command.token_ids, command.cache_salt, self.loads())
        if index is None:  # every process died since admission: their crash reports follow
            error = Unavailable(f"model {self.model_name!r}: no LLM engine process is running")
            if self._sink is not None:
                call_in_loop(self._loop, self._sink.on_step, [], [(command.request_id, error)])
            return
        num_tokens = len(command.token_ids)
        self._owners[command.request_id] = (index, num_tokens)
        self._num_requests[index] += 1
        self._num_tokens[index] += num_tokens
        self.children[index].submit(command)

    def pending(self) -> tuple[int, int]:
        """Adds not yet taken: requests of every process (the model's max_num_waiting bounds
        them all), prompt tokens of the least loaded (where the SLO admission check, which
        reads that process's budget state from here on, expects the request to go)."""
        num_requests = sum(c.pending()[0] for c in self.children if c.is_alive)
        least = least_loaded(self.loads())
        if least is None:
            return num_requests, 0
        child = self.children[least]
        budget, child_budget = self.front.budget, child.front.budget
        if budget is not None and child_budget is not None:
            budget.state = child_budget.state
        return num_requests, child.pending()[1]

    def restart(self) -> None:
        """After the last process died: restart every dead one at once (blocking); one that
        fails to load goes on restarting on its own while the others serve."""
        dead = [i for i, child in enumerate(self.children) if not child.is_alive]
        _, errors = _in_parallel(self._restart_child, dead)
        if not self._stopping and not self.is_alive:
            raise errors[min(errors)] if errors else ModelError("no engine process restarted")
        for index, exc in errors.items():
            if self._sink is not None:
                call_in_loop(self._loop, self._on_child_crash, index, exc)

    def stop(self, timeout_s: float) -> None:
        self._stopping = True
        call_in_loop(self._loop, self._cancel_restarts)
        _in_parallel(lambda i: self.children[i].stop(timeout_s), range(len(self.children)))

    # --- the processes' reports (on_step and on_crash on the loop) -----------------------

    def _on_child_step(
        self, index: int, outputs: list[RequestOutput], errors: list[tuple[str, FulcrumError]]
    ) -> None:
        for output in outputs:
            if output.finished or output.error is not None:
                self._release(output.request_id, index)
        for request_id, _ in errors:
            self._release(request_id, index)
        if self._sink is not None:
            self._sink.on_step(outputs, errors)

    def _on_child_waiting(self, index: int, num_waiting: int) -> None:
        with self._waiting_lock:
            self._waiting[index] = num_waiting
            if self._sink is not None:
                self._sink.set_num_waiting(sum(self._waiting))

    def _on_child_crash(self, index: int, exc: BaseException) -> None:
        victims = [rid for rid, (owner, _) in self._owners.items() if owner == index]
        for request_id in victims:
            del self._owners[request_id]
        self._num_requests[index] = self._num_tokens[index] = 0
        self._on_child_waiting(index, 0)
        self._gauges.clear(index)
        self._router.forget_child(index)  # its prefix cache is gone with it
        sink = self._sink
        if sink is None or self._stopping:
            return
        if not self.is_alive:  # none left: the model is down, as with one engine process
            sink.on_crash(exc)  # fails the streams left (these) and restarts the group
            return
        log.error("%s; %d requests failed, the other engine processes serve", exc, len(victims))
        if victims:
            failure = Unavailable(f"{exc}; it is being restarted")
            for _ in victims:
                self.metrics.request_finished("error")
            sink.on_step([], [(request_id, failure) for request_id in victims])
        self._schedule_restart(index)

    # --- single-process restarts (the loop owns the tasks; stop cancels them) -------------

    def _schedule_restart(self, index: int) -> None:
        backoff_s = self._trackers[index].on_crash(self.front.clock.now())
        if backoff_s is None:
            log.error("an engine process of %r crashed too often; it stays down while the "
                      "others serve", self.model_name)  # fmt: skip
            return
        task = asyncio.get_running_loop().create_task(self._restart_later(index, backoff_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart_later(self, index: int, backoff_s: float) -> None:
        await asyncio.sleep(backoff_s)  # the backoff deadline; nothing to wait on instead
        if self._stopping:
            return
        try:  # a new process, which loads the weights again
            restarted = await asyncio.to_thread(self._restart_child, index)
        except Exception as exc:
            log.exception("an engine process of %r failed to restart", self.model_name)
            self._trackers[index].on_restart(self.front.clock.now())
            self._on_child_crash(index, exc)
            return
        if restarted:
            self._trackers[index].on_restart(self.front.clock.now())
            self.num_restarts += 1
            self.metrics.restarts.inc()
            log.warning("engine process of %r restarted (pid %d)",
                        self.model_name, self.children[index].pid)  # fmt: skip

    def _restart_child(self, index: int) -> bool:
        """Restart one dead process (blocking); False if it was alive or we are stopping."""
        with self._restart_locks[index]:  # the group's restart and its own never overlap
            child = self.children[index]
            if self._stopping or child.is_alive:
                return False
            child.restart()
            return child.is_alive

    def _cancel_restarts(self) -> None:
        for task in self._tasks:
            task.cancel()

    # --- bookkeeping (loop) ---------------------------------------------------------------

    def _release(self, request_id: str, index: int) -> None:
        owner = self._owners.get(request_id)
        if owner is not None and owner[0] == index:  # not a reused id held by another
            del self._owners[request_id]
            self._unload(*owner)

    def _unload(self, index: int, num_tokens: int) -> None:
        self._num_requests[index] -= 1
        self._num_tokens[index] -= num_tokens


class _ChildSink:
    """What one process's client reports to: the group, told which process it is."""

    def __init__(self, group: EngineGroupClient, index: int) -> None:
        self._group, self._index = group, index

    def on_step(self, outputs: list[RequestOutput], errors: list[tuple[str, FulcrumError]]) -> None:
        self._group._on_child_step(self._index, outputs, errors)

    def on_crash(self, exc: BaseException) -> None:
        self._group._on_child_crash(self._index, exc)

    def set_num_waiting(self, num_waiting: int) -> None:
        self._group._on_child_waiting(self._index, num_waiting)


def _load_all(
    load: Callable[[int], ProcessEngineClient],
    num: int,
    available_bytes: Callable[[], int | None],
) -> list[ProcessEngineClient]:
    """The first process alone, the memory check, then the others at once; on any failure the
    ones loaded are stopped before the error is raised."""
    first = load(0)
    children = {0: first}
    try:
        check_memory(num, process_rss_bytes(first.pid), available_bytes())
        loaded, errors = _in_parallel(load, range(1, num))
        children.update(loaded)
        if errors:
            raise errors[min(errors)]
    except BaseException:
        _in_parallel(lambda i: children[i].stop(5.0), list(children))
        raise
    return [children[i] for i in range(num)]


def _in_parallel(
    fn: Callable[[int], T], indices: Iterable[int]
) -> tuple[dict[int, T], dict[int, Exception]]:
    """fn(i) for each index on threads of its own; results and errors by index."""
    indices = list(indices)
    if not indices:
        return {}, {}
    with ThreadPoolExecutor(len(indices), thread_name_prefix="llm-engine-group") as pool:
        futures = {i: pool.submit(fn, i) for i in indices}
    results: dict[int, T] = {}
    errors: dict[int, Exception] = {}
    for index, future in futures.items():
        exc = future.exception()
        if exc is None:
            results[index] = future.result()
        elif isinstance(exc, Exception):
            errors[index] = exc
        else:  # KeyboardInterrupt, SystemExit: not ours to hold
            raise exc
    return results, errors
