"""The memory budget counts a model whose weights live in a process of its own (an LLM with
`engine_process = true`) by that process's resident memory, read whenever the lifecycle asks,
plus what the load grew the server by; the files on disk only until the process can be read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from lifecycle_fakes import MB, FakeProbe, FakeServable, make_model
from prometheus_client import CollectorRegistry

from fulcrum.config import ModelConfig
from fulcrum.lifecycle.manager import EVICTION_GRACE_S, ModelLifecycle
from fulcrum.lifecycle.memory import process_rss_bytes
from fulcrum.metrics import LifecycleMetrics
from fulcrum.types import FakeClock

FRONT_MB = 5  # what the server itself grows by: the engine's weightless text front


class FakeChild:
    """An engine process as the budget sees it: a pid and a resident size the test sets
    (None: the process exited, and /proc has no entry for it)."""

    def __init__(self, pid: int, rss_mb: int | None) -> None:
        self.pid = pid
        self.rss_mb = rss_mb


class ProcessTable:
    """pid -> the fake child's RSS in bytes: the `ProcessRss` the lifecycle reads."""

    def __init__(self) -> None:
        self.children: dict[int, FakeChild] = {}
        self.num_reads = 0

    def __call__(self, pid: int) -> int | None:
        self.num_reads += 1
        child = self.children.get(pid)
        return None if child is None or child.rss_mb is None else child.rss_mb * MB


class ChildServable(FakeServable):
    """A servable that owns an engine process (as `LLMServable.child_pids` says)."""

    def __init__(self, config: ModelConfig, variant: str, child: FakeChild) -> None:
        super().__init__(config, variant)
        self.child = child

    @property
    def child_pids(self) -> tuple[int, ...]:
        return (self.child.pid,)


class ChildLoader:
    """Each load spawns a fake child of `child_mb[name]` MB and grows the server by FRONT_MB."""

    def __init__(self, probe: FakeProbe, table: ProcessTable) -> None:
        self.probe, self.table = probe, table
        self.child_mb: dict[str, int | None] = {}
        self.next_pid = 1000

    async def __call__(
        self, config: ModelConfig, version: int, path: Path, variant: str
    ) -> ChildServable:
        self.next_pid += 1
        child = FakeChild(self.next_pid, self.child_mb.get(config.name, 700))
        self.table.children[child.pid] = child
        self.probe.bytes += FRONT_MB * MB
        return ChildServable(config, variant, child)


class World:
    def __init__(self, root: Path, budget_mb: int | None = None) -> None:
        self.clock = FakeClock(100.0)
        self.probe = FakeProbe()
        self.table = ProcessTable()
        self.loader = ChildLoader(self.probe, self.table)
        self.registry = CollectorRegistry()
        self.life = ModelLifecycle(
            root,
            self.loader,
            LifecycleMetrics(self.registry),
            memory_budget_bytes=None if budget_mb is None else budget_mb * MB,
            clock=self.clock,
            probe=self.probe,
            process_rss=self.table,
        )

    def child(self, name: str) -> FakeChild:
        _, _, servable = self.life.repository.get(name)
        assert isinstance(servable, ChildServable)
        return servable.child


# --- the finding: the budget counted an engine process's weights by their files ------------


async def test_a_model_in_its_own_process_counts_that_process_rss(tmp_path: Path) -> None:
    make_model(tmp_path, "llm", weights_mb=100)  # on disk: what the budget estimated
    w = World(tmp_path)
    await w.life.load("llm")
    assert w.life.used_bytes == (700 + FRONT_MB) * MB
    assert w.life.stats_json("llm") == {
        "cold_start": {"count": 0, "ns": 0}, "cold_start_failures": 0, "idle_unloads": 0,
        "evictions": 0, "memory_bytes": (700 + FRONT_MB) * MB,
    }  # fmt: skip
    assert w.registry.get_sample_value("fulcrum_memory_used_bytes") == (700 + FRONT_MB) * MB


async def test_the_figure_follows_the_process_whenever_it_is_asked(tmp_path: Path) -> None:
    make_model(tmp_path, "llm")
    w = World(tmp_path)
    await w.life.load("llm")
    w.child("llm").rss_mb = 900  # its KV pool and int4 kernel copies filled in
    reads = w.table.num_reads
    assert w.life.used_bytes == (900 + FRONT_MB) * MB
    assert w.table.num_reads > reads  # read now, not remembered from the load
    labels = {"model": "llm"}
    gauge = w.registry.get_sample_value("fulcrum_model_memory_bytes", labels)
    assert gauge == (900 + FRONT_MB) * MB


async def test_a_process_that_cannot_be_read_keeps_the_estimate_then_the_last_figure(
    tmp_path: Path,
) -> None:
    make_model(tmp_path, "llm", weights_mb=100)
    w = World(tmp_path)
    w.loader.child_mb["llm"] = None  # gone before it could be read
    await w.life.load("llm")
    assert w.life.used_bytes == 100 * MB  # the files on disk, as before
    w.child("llm").rss_mb = 640
    assert w.life.used_bytes == (640 + FRONT_MB) * MB
    w.child("llm").rss_mb = None  # crashed: restarting
    assert w.life.used_bytes == (640 + FRONT_MB) * MB


async def test_eviction_sees_the_process_rss_not_the_file_size(tmp_path: Path) -> None:
    make_model(tmp_path, "big", weights_mb=100)
    make_model(tmp_path, "next", weights_mb=300)
    w = World(tmp_path, budget_mb=1000)
    await w.life.load("big")  # 705 MiB really, 100 MiB of files
    w.clock.advance(EVICTION_GRACE_S + 1)
    await w.life.load("next")  # needs 300 MiB: only evicting "big" makes room
    assert w.life.repository.is_parked("big")
    assert w.life.used_bytes == (700 + FRONT_MB) * MB  # "next" alone


# --- where the pids and sizes come from ------------------------------------------------------


class PidClient:
    """An engine client as `AsyncLLMEngine` holds it: a process's (`pid`) or a thread's (none)."""

    def __init__(self, pid: int | None) -> None:
        if pid is not None:
            self.pid = pid


def test_an_llm_servable_names_its_engine_process_and_a_thread_none() -> None:
    pytest.importorskip("torch")
    from fulcrum.llm.engine import AsyncLLMEngine
    from fulcrum.service_llm import LLMServable

    for pid, want in ((4321, (4321,)), (None, ())):
        engine = AsyncLLMEngine(
            object(),  # type: ignore[arg-type]  # the front: not used here
            model_name="m",
            client=PidClient(pid),  # type: ignore[arg-type]
        )
        assert engine.child_pids == want
        assert LLMServable(engine).child_pids == want


def test_a_process_rss_is_read_from_proc_and_none_once_it_exited() -> None:
    if not Path("/proc/self/statm").is_file():
        pytest.skip("no /proc here")
    assert (process_rss_bytes(os.getpid()) or 0) > MB
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_rss_bytes(child.pid) is None  # reaped: no /proc entry
