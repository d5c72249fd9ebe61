"""benchmarks/adaptive_ends.py: the bare app (ORT's default session options, and with --split a
Server-Timing `total` that times the handler as Fulcrum's does; built and compiled here, not
served), the light-load differences it prints, and its servers' searches taking turns."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import their siblings by name


def test_the_bare_app_keeps_ort_defaults_and_only_split_adds_the_timing_header() -> None:
    ends = importlib.import_module("adaptive_ends")
    plain, split = ends.bare_app(), ends.bare_app(split=True)
    for app in (plain, split):
        compile(app, "bare_app", "exec")
        assert "allow_spinning" not in app and "intra_op_num_threads" not in app
    assert "Server-Timing" not in plain
    assert 'response.headers["Server-Timing"] = f"total;dur={total_ms:.3f}"' in split
    # The timing wraps the whole handler: it starts before tokenizing and ends after the run.
    start = split.index("start_s = time.perf_counter()")
    assert start < split.index("tokenizer.encode_batch") < split.index("session.run")
    assert split.index("session.run") < split.index("total_ms = ")


def test_split_is_an_ends_option() -> None:
    import argparse

    ends = importlib.import_module("adaptive_ends")
    parser = argparse.ArgumentParser()
    ends.add_ends_args(parser)
    assert parser.parse_args(["--split"]).split is True
    assert parser.parse_args([]).split is False


def test_the_ends_report_prints_each_light_rate_and_all_of_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ends = importlib.import_module("adaptive_ends")

    def server(name: str, shift: float) -> SimpleNamespace:
        rng = np.random.default_rng(4)
        points = {
            label: [SimpleNamespace(cdf_ms=sorted(9.0 + shift + rng.exponential(1.0, 50)))
                    for _ in range(2)]
            for label in ("2 rps", "10 rps", "50% cap")
        }  # fmt: skip
        return SimpleNamespace(name=name, points=points)

    ends.light_against(server("bare", 0.0), [server("fulcrum shipped", -1.0)])
    out = capsys.readouterr().out
    assert "fulcrum shipped      P50   2 rps: -1.00" in out
    assert "fulcrum shipped      P99  10 rps: -1.00" in out
    assert "P50     all: -1.00" in out and "4 cells" in out
    assert "cap" not in out  # mid-load points are not light load


def test_the_servers_searches_take_their_points_in_turns() -> None:
    import asyncio

    turn_search = importlib.import_module("turn_search")
    taken: list[str] = []

    async def searcher(turns: Any, name: str, points: int) -> None:
        try:
            for _ in range(points):
                await turns.take(name)
                taken.append(name)
                await asyncio.sleep(0)  # a point's measurement: others get to run meanwhile
                await turns.pass_on(name)
        finally:
            await turns.pass_on(name, finished=True)

    async def main() -> None:
        turns = turn_search.Turns(["b", "a", "c"])
        await asyncio.gather(searcher(turns, "a", 1), searcher(turns, "b", 3),
                             searcher(turns, "c", 2))  # fmt: skip

    asyncio.run(main())
    assert taken == ["b", "a", "c", "b", "c", "b"]


def test_the_max_rate_is_the_median_of_the_searches() -> None:
    ends = importlib.import_module("adaptive_ends")
    server = ends.Server("fulcrum shipped", "http://127.0.0.1:1", [])
    assert server.max_rate is None
    server.max_rates = [300.0, 183.0]
    assert server.max_rate == 241.5  # of two searches, not the higher one
    server.max_rates = [None, 200.0, 100.0]  # a search that found no rate counts as 0
    assert server.max_rate == 100.0
