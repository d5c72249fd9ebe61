"""benchmarks/adaptive_ends.py's bare app: ORT's default session options, and with --split a
Server-Timing `total` that times the handler as Fulcrum's does (the app itself is a benchmark's
server: built and compiled here, not served)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

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
