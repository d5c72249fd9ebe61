"""`fulcrum bench` argument handling through `register`, and the compare form."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fulcrum.loadgen.cli import EXIT_ERROR, main, options_from_args, register
from fulcrum.loadgen.report import write_run
from fulcrum.loadgen.results import BenchRun


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fulcrum")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_options_from_the_command_line() -> None:
    args = parse(
        ["bench", "minilm", "--url", "http://h:9", "--concurrency", "1,2,4", "--rate", "50,100.5",
         "--arrivals", "gamma", "--burstiness", "0.5", "--duration", "6", "--window", "2",
         "--slo", "p99=100ms", "--slo", "ttft<=1s", "--max-rate-under", "p99=50ms",
         "--batch-size", "8", "--length", "8-64", "--openai", "--chat", "--max-tokens", "16"]
    )  # fmt: skip
    assert args.func is main
    options = options_from_args(args)
    assert options.model == "minilm" and options.url == "http://h:9"
    assert options.concurrency == (1, 2, 4) and options.rates == (50.0, 100.5)
    assert options.arrivals == "gamma" and options.burstiness == 0.5
    assert options.plan.max_duration_s == 6 and options.plan.window_s == 2
    assert options.slos == ("p99=100ms", "ttft<=1s") and options.max_rate_under == "p99=50ms"
    assert options.v2.batch_size == 8 and options.v2.lengths.high == 64
    assert options.openai and options.llm.chat and options.llm.max_tokens == 16


def test_window_never_exceeds_the_duration() -> None:
    options = options_from_args(parse(["bench", "m", "--duration", "1", "--window", "5"]))
    assert options.plan.window_s == 1


def test_bad_list_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit):
        parse(["bench", "m", "--concurrency", "1,x"])


def test_compare_form(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("a", "b"):
        write_run(BenchRun(model="m", url="u", label=f"run-{name}"), tmp_path / name)
    args = parse(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "run-a" in out and "run-b" in out


def test_errors_are_messages_and_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse(["bench", "compare", str(tmp_path / "missing")])
    assert args.func(args) == EXIT_ERROR
    assert "cannot read" in capsys.readouterr().err
    args = parse(["bench", "m", str(tmp_path)])  # run dirs without `compare`
    assert args.func(args) == EXIT_ERROR
    assert "did you mean compare" in capsys.readouterr().err
    args = parse(["bench", "m", "--slo", "p99"])
    assert args.func(args) == EXIT_ERROR
    assert "bad SLO" in capsys.readouterr().err
