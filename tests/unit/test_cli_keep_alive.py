"""`fulcrum serve --keep-alive-timeout`: parsed, validated, 5 s (as uvicorn and vLLM) by default."""

from __future__ import annotations

import pytest

from fulcrum.cli import build_parser


def test_keep_alive_timeout_default_and_override() -> None:
    parse = build_parser().parse_args
    assert parse(["serve", "--repository", "r"]).keep_alive_timeout == 5.0
    assert (
        parse(["serve", "--repository", "r", "--keep-alive-timeout", "75"]).keep_alive_timeout == 75
    )


def test_keep_alive_timeout_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--repository", "r", "--keep-alive-timeout", "0"])
    assert "must be > 0" in capsys.readouterr().err
