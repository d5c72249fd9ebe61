"""benchmarks/retry_storm.py imports, answers --help, and reads its variants right (the storm
itself is a benchmark: never run in tests)."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import their siblings by name


def test_help_names_its_options() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "retry_storm.py"), "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for flag in ("--clients", "--seconds", "--rounds", "--variant", "--capacity"):
        assert flag in done.stdout


def test_variants_name_a_tree_and_serve_flags() -> None:
    retry_storm = importlib.import_module("retry_storm")
    name, src, extra = retry_storm.parse_variant("off=src:--refusals-per-connection=0,--x=1")
    assert (name, src, extra) == ("off", Path("src").resolve(),
                                  ["--refusals-per-connection", "0", "--x", "1"])  # fmt: skip
    assert retry_storm.parse_variant("before=/tmp/b/src")[2] == []
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=SRC"):
        retry_storm.parse_variant("just-a-path")
    args = retry_storm.parse_args([])
    assert [v[0] for v in args.variant] == ["shipped"] and args.clients == 32


def test_percentiles_of_seconds_in_ms() -> None:
    retry_storm = importlib.import_module("retry_storm")
    values = [i / 1000 for i in range(1, 101)]
    assert retry_storm.percentile_ms(values, 0.5) == pytest.approx(51.0)
    assert retry_storm.percentile_ms(values, 0.99) == pytest.approx(100.0)
