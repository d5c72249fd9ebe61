"""`fulcrum tune` against a real `fulcrum serve` over echo models with a known latency model.

The echo backend sleeps `a + b * batch_rows` ms per batch, so batching raises the request rate a
config holds, and a queue delay longer than the SLO's bound breaks it at any rate. Windows are
short: the assertions rest on margins of 2x or more, never on tight timings.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from fulcrum.client import ClientError
from fulcrum.config import load_model_config
from fulcrum.demo import free_port, serve
from fulcrum.errors import ConfigError
from fulcrum.tuning.tune import TuneOptions, TuneResult
from fulcrum.tuning.tune_cli import register, run_tune

ECHO = """
platform = "echo"
max_batch_size = {max_batch}
[[inputs]]
name = "x"
datatype = "FP32"
shape = [4]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [4]
{batching}
[parameters]
latency_a_ms = {a_ms}
latency_b_ms = {b_ms}
"""
# Every request waits out the 80 ms queue delay (16 rows never gather at 100 rps): p99 > 60 ms.
QUEUED = ECHO.format(
    max_batch=16, batching="[dynamic_batching]\nmax_queue_delay_ms = 80.0", a_ms=10.0, b_ms=1.0
)
# No batcher: every request runs alone, 12 ms each, so about 83 requests/s at most; batches of
# 8 would serve about 300.
ALONE = ECHO.format(max_batch=8, batching="", a_ms=10.0, b_ms=2.0)
SHORT = {"point_s": 1.2, "warmup_s": 0.3, "num_cores": 2, "timeout_s": 5.0}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    repo = tmp_path_factory.mktemp("tune-repo")
    for name, text in (("queued", QUEUED), ("alone", ALONE)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.toml").write_text(text)
    log_path = repo.parent / "server.log"
    try:
        with serve(repo, free_port(), log_path=log_path) as url:
            yield url, repo
    except RuntimeError:
        print(log_path.read_text())
        raise


def served_config(url: str, model: str) -> dict[str, object]:
    response = httpx.get(f"{url}/v2/models/{model}/config", timeout=10)
    response.raise_for_status()
    config: dict[str, object] = response.json()
    return config


def test_refuses_a_config_that_breaks_the_slo_and_applies_one_that_meets_it(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    url, repo = served
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        ["tune", "queued", "--url", url, "--repository", str(repo), "--slo", "p99=60ms",
         "--rate", "100", "--only", "max_queue_delay_ms", "--budget-trials", "4", "--apply",
         "--point-seconds", "1.2", "--warmup", "0.3", "--cores", "2", "--timeout", "5",
         "--out", str(tmp_path / "out")]
    )  # fmt: skip
    assert args.func(args) == 0
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 0
    result = msgspec.json.decode((tmp_path / "out" / "tune.json").read_bytes(), type=TuneResult)
    current = result.trials[0]
    assert current.phase == "current" and current.changes == {}
    assert not current.feasible and "p99=60ms broken" in current.reasons[0]
    assert result.confirmation == []  # nothing to confirm against a config that breaks the SLO
    winner = result.trial(result.winner)
    assert winner is not None and winner.feasible and winner.figures is not None
    assert winner.figures.latency_ms <= 60.0
    delay_ms = winner.candidate.max_queue_delay_ms
    assert delay_ms <= 1.0  # the sweep tried 0, 0.5 and 1 ms within the budget
    # --apply wrote the winner into the file, and the server now serves that file.
    assert "-max_queue_delay_ms = 80.0" in result.diff and result.applied
    written = load_model_config(repo / "queued" / "config.toml", dir_name="queued")
    assert written.dynamic_batching is not None
    assert written.dynamic_batching.max_queue_delay_ms == delay_ms
    batching = served_config(url, "queued")["dynamic_batching"]
    assert isinstance(batching, dict)
    assert batching["max_queue_delay_microseconds"] == round(delay_ms * 1000)


def test_a_repository_that_is_not_the_servers_is_refused(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    url, _ = served
    other = tmp_path / "other"
    for name in ("alone", "absent"):
        (other / name / "1").mkdir(parents=True)
        (other / name / "config.toml").write_text(
            ALONE.replace("max_batch_size = 8", "max_batch_size = 4")
        )
    options = TuneOptions(model="alone", repository=other, url=url, slos=("p99=100ms",), **SHORT)
    with pytest.raises(ConfigError, match="not the one in --repository"):
        run_tune(options, echo=False)
    options = TuneOptions(model="absent", repository=other, url=url, slos=("p99=100ms",), **SHORT)
    with pytest.raises(ClientError, match="HTTP 404"):
        run_tune(options, echo=False)
    assert "dynamic_batching" not in served_config(url, "alone")  # restored all the same


def test_batching_beats_the_default_and_the_server_is_restored(
    served: tuple[str, Path],
) -> None:
    url, repo = served
    before = (repo / "alone" / "config.toml").read_text()
    options = TuneOptions(
        model="alone", repository=repo, url=url, slos=("p99=100ms",),
        only=("max_batch_size",), budget_trials=5, search_start_rps=40.0, search_steps=4,
        confirm_rounds=1, **SHORT,
    )  # fmt: skip
    result = run_tune(options, echo=False)
    current = result.trials[0]
    winner = result.trial(result.winner)
    assert winner is not None and winner.feasible and winner.figures is not None
    assert winner.figures.latency_ms <= 100.0
    assert winner.candidate.batching and winner.candidate.max_batch_size >= 2
    assert current.figures is not None
    # Batching holds at least 1.5x the rate of one request at a time (the model says ~3x).
    assert winner.figures.goodput_rps >= 1.5 * current.figures.goodput_rps
    assert [t.candidate.max_batch_size for t in result.trials[1:]] == [1, 2, 4, 8]
    # Re-measured once more each, in alternation, the gain held.
    assert sorted(c.trial for c in result.confirmation) == [0, winner.index]
    assert all(len(c.goodputs) == 2 for c in result.confirmation)
    # Without --apply the file is untouched and the server serves it again: no batcher.
    assert "+[dynamic_batching]" in result.diff and not result.applied
    assert (repo / "alone" / "config.toml").read_text() == before
    assert "dynamic_batching" not in served_config(url, "alone")
