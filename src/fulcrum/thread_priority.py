"""Compute threads at a lower CPU priority than the event loop (`fulcrum serve --compute-nice`).

On a machine with as many busy compute threads as cores, a refusal or a health probe waits for
the event loop to get a core; at a higher nice value the compute threads yield it sooner. Linux
threads inherit their creator's nice value, so each instance thread lowers itself as it starts,
and backends are built on a lowered thread so that the pools they spawn (ONNX Runtime's, torch's
OpenMP team) are born lowered too; the event loop's thread keeps its own priority.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fulcrum.errors import ConfigError

_logger = logging.getLogger(__name__)

MAX_NICE = 19  # Linux's lowest priority
# Measured at 3x overload on 2 cores (benchmarks/overload_minute.py --compute-nice 0,5, quiet, with
# minilm's dynamic_block_base = 4): 503 P99 8-16 ms at 5 against 24-25 ms at 0, goodput no lower.
DEFAULT_COMPUTE_NICE = 5
T = TypeVar("T")


def check_compute_nice(value: int) -> int:
    """`value` if it is a valid compute niceness (0-19), else ConfigError naming it."""
    if not 0 <= value <= MAX_NICE:
        raise ConfigError(f"compute_nice = {value}: must be 0-{MAX_NICE} (0: not lowered)")
    return value


def thread_nice(native_id: int | None = None) -> int:
    """The nice value of a thread of this process (default: the calling one). On Linux,
    PRIO_PROCESS with a thread id addresses that thread alone."""
    return os.getpriority(os.PRIO_PROCESS, native_id or threading.get_native_id())


def lower_this_thread(nice: int) -> bool:
    """Set the calling thread's nice value to `nice` (never raising it above what it is);
    whether it now runs at `nice`. Where that cannot be done, logs once and carries on."""
    if not sys.platform.startswith("linux"):
        # Elsewhere PRIO_PROCESS names a whole process: lowering "this thread" would lower the
        # event loop with it.
        _warn_once(f"compute_nice is applied on Linux only, not on {sys.platform}")
        return False
    try:
        if thread_nice() < nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:  # a sandbox that forbids setpriority
        _warn_once(f"cannot lower the compute threads' priority to nice {nice}: {exc}")
        return False
    return thread_nice() == nice


def compute_initializer(increment: int) -> Callable[[], None] | None:
    """A thread initializer that lowers each new thread `increment` nice steps below the
    calling thread (read now, on the thread that builds the pool); None for 0: nothing to do."""
    if check_compute_nice(increment) == 0:
        return None
    nice = min(MAX_NICE, thread_nice() + increment)
    return functools.partial(_lower_quietly, nice)


async def call_lowered(increment: int, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` off the event loop, on a fresh thread `increment` nice steps below the loop's,
    so the threads it spawns (a runtime's pool) inherit that priority; for 0 a plain
    `asyncio.to_thread` call. A fresh thread, as a lowered thread cannot be raised back without
    privilege: the shared default executor must keep the loop's priority."""
    initializer = compute_initializer(increment)
    if initializer is None:
        return await asyncio.to_thread(fn, *args)
    executor = ThreadPoolExecutor(1, "fulcrum-load", initializer=initializer)
    try:
        return await asyncio.wrap_future(executor.submit(fn, *args))
    finally:
        executor.shutdown(wait=False)  # the thread ends once fn returns, even if we left early


def _lower_quietly(nice: int) -> None:
    lower_this_thread(nice)


@functools.cache
def _warn_once(message: str) -> None:
    _logger.warning(message)
