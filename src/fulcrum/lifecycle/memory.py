"""What a loaded model costs and what the budget allows: the process's memory as a probe reads
it, a model's size on disk as a floor, the resident memory of the processes a model owns (an LLM
engine process), and the pure choice of which idle models to evict."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

MIB = 1024 * 1024
# The libraries a platform's first load imports: hundreds of MiB of code and arenas the whole
# process keeps, imported before a load is measured so they are not charged to one model.
PLATFORM_LIBRARIES = {"onnx": ("onnxruntime",), "torch": ("torch",), "llm": ("torch",)}


class MemoryProbe(Protocol):
    """The memory the process holds now, in bytes (host, plus device memory where it can tell)."""

    def used_bytes(self) -> int: ...


class ProcessMemory:
    """Resident set size from /proc (Linux), plus what torch holds on CUDA devices once torch
    has initialised CUDA: an LLM's weights and KV pool live there, not in the RSS."""

    def used_bytes(self) -> int:
        return _rss_bytes() + _cuda_bytes()


def _rss_bytes() -> int:
    return process_rss_bytes("self") or 0  # no /proc: the on-disk floor alone sizes each model


# A process id -> its resident set size in bytes, None when it cannot be read (it has exited).
ProcessRss = Callable[[int], int | None]


def process_rss_bytes(pid: int | str) -> int | None:
    """Resident set size of process `pid` ("self": this one) from /proc (Linux), else None."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def child_pids(servables: Iterable[object]) -> tuple[int, ...]:
    """The processes the servables own (`child_pids`: an LLM's engine process), whose memory
    this process's RSS does not hold."""
    return tuple(pid for s in servables for pid in getattr(s, "child_pids", ()))


def owned_bytes(servables: Iterable[object], own_bytes: int, rss: ProcessRss) -> int | None:
    """What a model whose weights live in processes of its own costs now: their resident
    memory, read now, plus `own_bytes` (what its load grew this process by); None when it owns
    no process or one cannot be read (exited: restarting)."""
    sizes = [rss(pid) for pid in child_pids(servables)]
    if not sizes or any(size is None for size in sizes):
        return None
    return own_bytes + sum(size or 0 for size in sizes)


def _cuda_bytes() -> int:
    torch = sys.modules.get("torch")  # never import it here: a server without torch stays light
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return sum(int(torch.cuda.memory_reserved(i)) for i in range(torch.cuda.device_count()))


async def import_libraries(platform: str) -> None:
    """Import `platform`'s libraries now (on a worker thread: torch takes seconds)."""
    for name in PLATFORM_LIBRARIES.get(platform, ()):
        if name not in sys.modules:
            with contextlib.suppress(ImportError):  # the load itself names the missing extra
                await asyncio.to_thread(importlib.import_module, name)


def folder_bytes(folders: Iterable[Path]) -> int:
    """Bytes of the files under `folders` (a model's version folders): the weights a load reads."""
    total = 0
    for folder in folders:
        for path in folder.rglob("*"):
            try:
                total += path.stat().st_size if path.is_file() else 0
            except OSError:
                continue  # removed while walking: it will not be loaded either
    return total


@dataclass(frozen=True, slots=True)
class Resident:
    """A loaded model as the budget sees it."""

    name: str
    memory_bytes: int
    last_used_s: float
    evictable: bool  # False: in flight, loading, pinned (`evictable = false`) or the one loading


@dataclass(frozen=True, slots=True)
class EvictionPlan:
    """Which models to unload, least recently used first, so `need_bytes` fits; `fits` is False
    when even evicting every evictable model would not make room."""

    evict: tuple[str, ...]
    fits: bool
    free_bytes: int  # free before any eviction (negative: already over the budget)


def plan_eviction(
    residents: Iterable[Resident], need_bytes: int, budget_bytes: int
) -> EvictionPlan:
    """The least recently used evictable models to unload so that `need_bytes` more fit."""
    models = list(residents)
    free_bytes = budget_bytes - sum(r.memory_bytes for r in models)
    room = free_bytes
    chosen: list[str] = []
    for resident in sorted((r for r in models if r.evictable), key=lambda r: r.last_used_s):
        if need_bytes <= room:
            break
        chosen.append(resident.name)
        room += resident.memory_bytes
    return EvictionPlan(tuple(chosen), need_bytes <= room, free_bytes)


def mib(num_bytes: int) -> str:
    """Bytes as MiB for messages: one decimal below 10 MiB."""
    value = num_bytes / MIB
    return f"{value:.1f}" if abs(value) < 10 else f"{value:.0f}"


def over_budget(
    name: str, need_bytes: int, budget_bytes: int, free_bytes: int, in_use: list[str]
) -> str:
    """Why a load of `name` cannot fit the budget, for its 503."""
    if need_bytes > budget_bytes:
        return (
            f"model '{name}' needs about {mib(need_bytes)} MiB, more than the whole memory "
            f"budget ({mib(budget_bytes)} MiB)"
        )
    return (
        f"model '{name}' needs about {mib(need_bytes)} MiB; the memory budget "
        f"({mib(budget_bytes)} MiB) has {mib(max(0, free_bytes))} MiB free and no idle model to "
        f"unload (in use or pinned: {', '.join(sorted(in_use)) or 'none'})"
    )
