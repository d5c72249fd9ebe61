"""A real `fulcrum serve` process on a free loopback port, over the example repository."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fulcrum.demo import free_port, serve


@pytest.fixture(scope="session")
def server_url(example_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    try:
        with serve(example_repo, free_port(), log_path=log_path) as url:
            yield url
    except RuntimeError:
        print(log_path.read_text())
        raise
