"""benchmarks/overload_minute.py: its --configs specs, --compute-nice rounds and thread counters.

The benchmark itself (servers, timings) is not run here: speed is never asserted in tests.
"""

from __future__ import annotations

import importlib
import sys
import threading
from pathlib import Path

import psutil
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import their siblings by name
overload_minute = importlib.import_module("overload_minute")


def write_repo(root: Path) -> Path:
    (root / "minilm").mkdir()
    (root / "minilm" / "config.toml").write_text(
        'platform = "onnx"\n[parameters]\nintra_op_threads = 2\nlength_bucket_rows = 8\n'
    )
    return root


def test_plain_configs_keep_their_overrides(tmp_path: Path) -> None:
    repo = write_repo(tmp_path)
    assert overload_minute.config_override(repo, "shipped", 100.0) is None
    assert overload_minute.config_override(repo, "adaptive", 80.0) == {
        "dynamic_batching": {"policy": "adaptive", "slo_p99_ms": 80.0}
    }
    assert overload_minute.config_override(repo, "triton", 80.0) == {
        "dynamic_batching": {"policy": "triton"}
    }


def test_triton_keeps_the_files_batching_table_with_only_the_policy_changed(
    tmp_path: Path,
) -> None:
    """A reload override replaces a whole top-level table: dropping preferred_batch_sizes and
    the SLO would measure some other config than the file's."""
    repo = write_repo(tmp_path)
    config = repo / "minilm" / "config.toml"
    config.write_text(
        config.read_text()
        + '[dynamic_batching]\npolicy = "adaptive"\nslo_p99_ms = 100\n'
        + "preferred_batch_sizes = [16]\n"
    )
    assert overload_minute.config_override(repo, "triton", 80.0) == {
        "dynamic_batching": {"policy": "triton", "slo_p99_ms": 100, "preferred_batch_sizes": [16]}
    }


def test_parameters_after_at_are_laid_over_the_files_parameters(tmp_path: Path) -> None:
    repo = write_repo(tmp_path)
    spec = "adaptive@dynamic_block_base=4;intra_op_threads=1"
    assert overload_minute.config_override(repo, spec, 100.0) == {
        "dynamic_batching": {"policy": "adaptive", "slo_p99_ms": 100.0},
        "parameters": {"intra_op_threads": 1, "length_bucket_rows": 8, "dynamic_block_base": 4},
    }
    assert overload_minute.config_override(repo, "shipped@dynamic_block_base=2", 100.0) == {
        "parameters": {"intra_op_threads": 2, "length_bucket_rows": 8, "dynamic_block_base": 2}
    }
    with pytest.raises(KeyError):
        overload_minute.config_override(repo, "fastest", 100.0)


def test_compute_nice_and_repeats_parse() -> None:
    args = overload_minute.parse_args(["--compute-nice", "0,2,5", "--repeats", "2"])
    assert args.compute_nice == "0,2,5" and args.repeats == 2
    defaults = overload_minute.parse_args([])
    assert defaults.compute_nice == "0" and defaults.repeats == 1


def test_thread_counters_name_the_main_thread_and_count_other_threads() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(10.0,))
    thread.start()
    try:
        me = psutil.Process()
        switches = overload_minute.thread_switches(me)
        nices = overload_minute.thread_nices(me)
    finally:
        release.set()
        thread.join()
    assert "main" in switches and "main" in nices
    assert all(len(v) == 2 and min(v) >= 0 for v in switches.values())
    assert sum(v[0] for v in switches.values()) > 0  # a waiting thread has switched voluntarily
