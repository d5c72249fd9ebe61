"""config.toml parsing and validation: every error names the file, the key and the value."""

from __future__ import annotations

from pathlib import Path

import pytest

from fulcrum.config import check_model_name, load_model_config
from fulcrum.errors import ConfigError

BASE = 'platform = "echo"\nmax_batch_size = 8\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "m" / "config.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_and_queue_policy(tmp_path: Path) -> None:
    text = BASE + (
        "[dynamic_batching]\npriority_levels = 3\ndefault_priority_level = 2\n"
        "[dynamic_batching.default_queue_policy]\nmax_queue_size = 5\n"
        "[dynamic_batching.priority_queue_policy.1]\nmax_queue_size = 9\n"
        'timeout_action = "delay"\n'
    )
    config = load_model_config(write(tmp_path, text), dir_name="m")
    assert config.name == "m"
    assert config.default_priority == 2
    assert config.queue_policy(1).max_queue_size == 9
    assert config.queue_policy(1).timeout_action == "delay"
    assert config.queue_policy(3).max_queue_size == 5


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("platform = 3\n", "key 'platform'"),
        ('platform = "tea"\n', "key 'platform' = 'tea'"),
        (BASE + "max_batch_size = -1\n", "not valid TOML"),
        ('platform = "echo"\nmax_batch_size = -1\n', "key 'max_batch_size' = -1"),
        ('platform = "echo"\nmax_batch_size = 1000000000000\n', "must lie in 0..1048576"),
        (BASE + "[dynamic_batching]\nmax_queue_delay_ms = inf\n", "max_queue_delay_ms' = inf"),
        (BASE + "[dynamic_batching]\nmax_queue_delay_ms = nan\n", "max_queue_delay_ms' = nan"),
        (
            BASE + "[dynamic_batching.default_queue_policy]\ndefault_timeout_ms = inf\n",
            "default_timeout_ms' = inf",
        ),
        (BASE + '[[inputs]]\nname = "x"\ndatatype = "FP33"\n', "key 'inputs[0].datatype' = 'FP33'"),
        (BASE + '[[inputs]]\nname = "x"\ndatatype = "FP32"\nshape = [0]\n', "inputs[0].shape"),
        (
            BASE + '[[inputs]]\nname = "x"\ndatatype = "FP32"\n[[inputs]]\nname = "x"\n'
            'datatype = "FP32"\n',
            "duplicate",
        ),
        (BASE + "[dynamic_batching]\npreferred_batch_sizes = [16]\n", "preferred_batch_sizes"),
        (BASE + "[dynamic_batching]\nmax_queue_delay_ms = -1\n", "max_queue_delay_ms"),
        ('platform = "echo"\n[dynamic_batching]\n', "needs max_batch_size"),
        (BASE + "[dynamic_batching.priority_queue_policy.4]\n", "priority_queue_policy.4"),
        (BASE + "[version_policy]\nlatest = 2\nall = true\n", "choose one"),
        (BASE + "surprise = 1\n", "surprise"),
        (BASE + "[instances]\ncount = 0\n", "instances.count"),
        ('name = "other"\n' + BASE, "differs from its folder"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, text: str, fragment: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_model_config(path, dir_name="m")
    # named relative to the repository root: error texts reach clients (issue 9, finding 2)
    assert info.value.message.startswith("m/config.toml: ")
    assert str(tmp_path) not in info.value.message
    assert fragment in info.value.message


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_model_config(tmp_path / "missing.toml")


@pytest.mark.parametrize("name", ["minilm", "model..1", "a.b-c_d", "v2..", "7", "x" * 128])
def test_model_names_that_stay_inside_the_repository(name: str) -> None:
    assert check_model_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["minilm\n", "minilm\r", ".", "..", ".hidden", "-flag", "a/b", "a\\b", "../x", "a\x00",
     "a\tb", "", " m", "é", "x" * 129],
)  # fmt: skip
def test_model_names_that_could_escape_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="invalid model name"):
        check_model_name(name)
