"""Shared fixtures: `example_repo`, a model repository built once per test session; `release`,
the event a test's hung backend calls wait on."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fulcrum.examples import build_examples

pytest_plugins = ("redis_fixture",)  # `redis_server`: a real redis-server (tests/redis_fixture.py)


@pytest.fixture(scope="session")
def example_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository holding every example model (`minilm`, ...); treat it as read-only."""
    directory = tmp_path_factory.mktemp("models")
    build_examples(directory)
    return directory


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """The event every hung backend call waits on; set at the end so no thread outlives its
    test."""
    event = threading.Event()
    yield event
    event.set()
