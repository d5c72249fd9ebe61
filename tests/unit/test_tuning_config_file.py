"""Config writes keep the user's comments and layout, and never leave a config the server would
refuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from fulcrum.config import VariantFigures
from fulcrum.errors import ConfigError
from fulcrum.tuning.config_file import edit_config, set_values, set_variant

ORIGINAL = """# The echo model: tuned by hand once.
platform = "echo"  # a fake backend
max_batch_size = 8

[dynamic_batching]
# Wait a little for company.
max_queue_delay_ms = 1

[parameters]
latency_a_ms = 1  # fixed cost per batch
"""


@pytest.fixture
def path(tmp_path: Path) -> Path:
    (tmp_path / "echo").mkdir()
    config = tmp_path / "echo" / "config.toml"
    config.write_text(ORIGINAL)
    return config


def test_set_values_keeps_comments_and_adds_missing_tables(path: Path) -> None:
    edit = edit_config(
        path,
        set_values({"dynamic_batching.max_queue_delay_ms": 2.5, "instances.count": 2,
                    "max_batch_size": 16}),
    )  # fmt: skip
    text = path.read_text()
    assert text == edit.new_text
    for comment in ("# The echo model", "# a fake backend", "# Wait a little", "# fixed cost"):
        assert comment in text
    assert "max_queue_delay_ms = 2.5" in text and "[instances]\ncount = 2" in text
    assert edit.config.max_batch_size == 16 and edit.config.instances.count == 2
    assert "-max_queue_delay_ms = 1\n+max_queue_delay_ms = 2.5" in edit.diff
    assert edit.diff.startswith("--- a/echo/config.toml\n+++ b/echo/config.toml")


def test_dry_run_leaves_the_file_and_none_removes_a_key(path: Path) -> None:
    edit = edit_config(path, set_values({"dynamic_batching.max_queue_delay_ms": None}), write=False)
    assert path.read_text() == ORIGINAL
    assert "max_queue_delay_ms" not in edit.new_text and edit.changed


def test_an_edit_the_server_would_refuse_is_not_written(path: Path) -> None:
    with pytest.raises(ConfigError, match=r"would not load: .*max_batch_size"):
        edit_config(path, set_values({"max_batch_size": -1}))
    with pytest.raises(ConfigError, match=r"parameters\.latency_a_ms"):
        edit_config(path, set_values({"parameters.latency_a_ms": "slow"}))
    assert path.read_text() == ORIGINAL


def test_set_variant_adds_then_updates_in_place(path: Path) -> None:
    figures = VariantFigures(size_bytes=100, fidelity=0.99, fidelity_metric="cosine")
    edit_config(path, set_variant("fast", parameters={"latency_a_ms": 0.5}, precision="int8",
                                  figures=figures))  # fmt: skip
    text = path.read_text()
    text = text.replace('precision = "int8"', 'precision = "int8"  # my note')
    path.write_text(text)
    again = VariantFigures(size_bytes=90, fidelity=0.98, fidelity_metric="cosine")
    edit = edit_config(path, set_variant("fast", parameters={"latency_a_ms": 0.4}, figures=again))
    variant = edit.config.variants["fast"]
    assert variant.parameters == {"latency_a_ms": 0.4}
    assert (variant.figures.size_bytes, variant.figures.fidelity) == (90, 0.98)
    assert variant.figures.latency_ms is None  # unmeasured figures are left out, not zeros
    assert '"int8"  # my note' in edit.new_text and "# fixed cost per batch" in edit.new_text
