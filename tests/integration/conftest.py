"""Fixtures shared by the integration tests that run a `Service` in process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fulcrum.service import Service

if TYPE_CHECKING:
    from fulcrum.llm.engine import AsyncLLMEngine


@pytest.fixture
async def service(repo: Path) -> AsyncIterator[Service]:
    """The test module's `repo` fixture, served by a started Service (stopped afterwards)."""
    started = Service.from_repository(repo)
    await started.start()
    yield started
    await started.stop()


@pytest.fixture
def engine(service: Service) -> AsyncLLMEngine:
    """The engine of the module's generative model named `tiny` (imported here, not at
    collection: torch loads only for the modules that use it)."""
    from fulcrum.service_llm import LLMServable

    servable = service._repository.get("tiny")[2]
    assert isinstance(servable, LLMServable)
    return servable.engine
