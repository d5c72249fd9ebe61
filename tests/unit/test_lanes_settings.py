"""Lanes in config.toml: each lane's resolved config, errors that name the lane's key, LLMs
refused, and the check of the lanes' threads against the machine's cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from fulcrum.config import ModelConfig, load_model_config
from fulcrum.errors import ConfigError
from fulcrum.lanes.settings import default_lane, lane_config, lane_variant, oversubscription

BASE = """platform = "onnx"
max_batch_size = 64
inputs = [{name = "x", datatype = "FP32", shape = [2]}]
outputs = [{name = "y", datatype = "FP32", shape = [2]}]
[dynamic_batching]
max_queue_delay_ms = 5
[instances]
count = 2
[parameters]
model_file = "model.onnx"
intra_op_threads = 4
[variants.fp32]
[variants.int8]
parameters = { model_file = "model.int8.onnx" }
"""
LANES = """
[lanes.realtime]
variant = "int8"
threads = 1
instances = { count = 1 }
[lanes.realtime.dynamic_batching]
profile = "realtime"
slo_p99_ms = 20
[lanes.bulk]
variant = "fp32"
"""


def load(tmp_path: Path, text: str) -> ModelConfig:
    path = tmp_path / "m" / "config.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return load_model_config(path, dir_name="m")


def test_a_lane_is_its_variant_with_its_own_instances_threads_and_batching(
    tmp_path: Path,
) -> None:
    config = load(tmp_path, BASE + LANES)
    assert list(config.lanes) == ["realtime", "bulk"]
    realtime = lane_config(config, "realtime")
    assert realtime.parameters["model_file"] == "model.int8.onnx"
    assert realtime.parameters["intra_op_threads"] == 1
    assert realtime.instances.count == 1
    batching = realtime.dynamic_batching
    assert batching is not None
    # The lane's own profile filled what its table left out, not the model's table.
    assert (batching.policy, batching.max_queue_delay_ms, batching.slo_p99_ms) == (
        "adaptive", 0.0, 20.0)  # fmt: skip
    assert realtime.lanes == {}
    bulk = lane_config(config, "bulk")  # left out: the model's values
    assert bulk.parameters == {"model_file": "model.onnx", "intra_op_threads": 4}
    assert bulk.instances.count == 2
    assert bulk.dynamic_batching == config.dynamic_batching


def test_the_default_lane_is_the_first_unless_named(tmp_path: Path) -> None:
    assert default_lane(load(tmp_path, BASE + LANES)) == "realtime"
    assert default_lane(load(tmp_path, 'default_lane = "bulk"\n' + BASE + LANES)) == "bulk"


def test_a_lane_without_variant_runs_the_default_variant(tmp_path: Path) -> None:
    config = load(tmp_path, 'default_variant = "int8"\n' + BASE + "[lanes.any]\n")
    assert lane_variant(config, "any") == "int8"


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ('[lanes.fast]\nvariant = "fp8"\n', "key 'lanes.fast.variant' = 'fp8'"),
        ("[lanes.fast]\nthreads = -1\n", "key 'lanes.fast.threads' = -1"),
        ("[lanes.fast]\ninstances = { count = 0 }\n", "key 'lanes.fast.instances.count' = 0"),
        (
            '[lanes.fast.dynamic_batching]\npolicy = "adaptive"\n',
            "key 'lanes.fast.dynamic_batching.slo_p99_ms' = 0.0",
        ),
        (
            "[lanes.fast.dynamic_batching]\npreferred_batch_sizes = [128]\n",
            "key 'lanes.fast.dynamic_batching.preferred_batch_sizes' = [128]",
        ),
        ("[lanes.fast]\nspeed = 1\n", "speed"),
    ],
)
def test_lane_errors_name_the_key(tmp_path: Path, extra: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, BASE + extra)
    assert fragment in info.value.message
    assert info.value.message.startswith("m/config.toml: ")


def test_a_default_lane_that_is_not_declared_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="key 'default_lane' = 'slow': not one of the lanes"):
        load(tmp_path, 'default_lane = "slow"\n' + BASE + LANES)
    with pytest.raises(ConfigError, match=r"key 'default_lane' = 'slow': no \[lanes\]"):
        load(tmp_path, 'default_lane = "slow"\n' + BASE)


def test_a_lane_over_a_variant_that_does_not_load_is_refused(tmp_path: Path) -> None:
    text = BASE.replace("[variants.int8]\n", "[variants.int8]\nload = false\n") + LANES
    with pytest.raises(ConfigError, match=r"key 'lanes\.realtime\.variant' = 'int8'"):
        load(tmp_path, text)


def test_generative_models_take_no_lanes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"platform 'llm'.* takes no lanes"):
        load(tmp_path, 'platform = "llm"\n[lanes.fast]\n')


def test_threads_beyond_the_cores_are_reported(tmp_path: Path) -> None:
    config = load(tmp_path, BASE + LANES)
    # realtime: 1 instance x 1 thread; bulk: 2 instances x 4 threads.
    assert oversubscription(config, num_cores=9) is None
    warning = oversubscription(config, num_cores=8)
    assert warning is not None
    assert "9 threads on 8 cores (realtime: 1, bulk: 8)" in warning


def test_a_thread_count_left_to_the_runtime_counts_every_core(tmp_path: Path) -> None:
    config = load(tmp_path, BASE.replace("intra_op_threads = 4\n", "") + LANES)
    warning = oversubscription(config, num_cores=4)
    assert warning is not None and "(realtime: 1, bulk: 8)" in warning
