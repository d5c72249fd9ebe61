"""Whether another process has exited: the engine-process tests check that no child outlives
its server (killed, exited without stopping its client, or an orphaned group)."""

from __future__ import annotations

import time
from pathlib import Path


def pid_gone(pid: int) -> bool:
    """The process has exited (gone, or a zombie that whoever adopted it has not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Whether the process exits within `timeout_s`."""
    deadline_s = time.monotonic() + timeout_s
    while not pid_gone(pid):
        if time.monotonic() > deadline_s:
            return False
        time.sleep(0.05)  # another process's exit: nothing to block on
    return True
