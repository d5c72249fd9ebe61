"""Fixtures shared by the integration tests that run a `Service` in process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fulcrum.service import Service


@pytest.fixture
async def service(repo: Path) -> AsyncIterator[Service]:
    """The test module's `repo` fixture, served by a started Service (stopped afterwards)."""
    started = Service.from_repository(repo)
    await started.start()
    yield started
    await started.stop()
