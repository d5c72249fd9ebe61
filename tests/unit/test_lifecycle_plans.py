"""The lifecycle's pure decisions: which idle models unload and when to look again, which models
the memory budget evicts, what a model's files weigh, and the `[lifecycle]` table's checks."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

from fulcrum.config import ModelConfig, validate
from fulcrum.errors import ConfigError
from fulcrum.lifecycle import memory
from fulcrum.lifecycle.idle import BUSY_RECHECK_S, Activity, num_in_flight, plan_idle
from fulcrum.lifecycle.memory import Resident, folder_bytes, import_libraries, mib, plan_eviction
from fulcrum.lifecycle.settings import LifecycleSettings, validate_lifecycle


def test_idle_model_unloads_at_its_idle_time_and_not_before() -> None:
    model = Activity("a", idle_unload_s=10.0, last_used_s=100.0, busy=False)
    early = plan_idle([model], now_s=109.999)
    assert early.unload == ()
    assert early.next_check_s == pytest.approx(110.0)
    assert plan_idle([model], now_s=110.0).unload == ("a",)


def test_busy_model_never_unloads_and_is_looked_at_again_soon() -> None:
    busy = Activity("a", idle_unload_s=10.0, last_used_s=0.0, busy=True)
    plan = plan_idle([busy], now_s=1000.0)
    assert plan.unload == ()
    assert plan.next_check_s == pytest.approx(1000.0 + BUSY_RECHECK_S)


def test_model_without_idle_time_is_never_watched() -> None:
    never = Activity("a", idle_unload_s=0.0, last_used_s=0.0, busy=False)
    assert plan_idle([never], now_s=1e9) == plan_idle([], now_s=1e9)
    assert plan_idle([never], now_s=1e9).next_check_s is None


def test_next_check_is_the_earliest_idle_deadline() -> None:
    models = [
        Activity("a", idle_unload_s=30.0, last_used_s=0.0, busy=False),
        Activity("b", idle_unload_s=5.0, last_used_s=10.0, busy=False),
        Activity("c", idle_unload_s=5.0, last_used_s=0.0, busy=False),
    ]
    plan = plan_idle(models, now_s=12.0)
    assert plan.unload == ("c",)
    assert plan.next_check_s == pytest.approx(15.0)


class Admitting:
    def __init__(self, num_admitted: int) -> None:
        self.num_admitted = num_admitted


class LaneGroupLike:
    def __init__(self, lanes: dict[str, Admitting]) -> None:
        self.lanes = lanes


def test_requests_in_flight_are_counted_across_a_lane_group() -> None:
    assert num_in_flight(Admitting(2)) == 2
    assert num_in_flight(LaneGroupLike({"realtime": Admitting(1), "bulk": Admitting(3)})) == 4
    assert num_in_flight(object()) == 0  # a servable that reports none


def resident(name: str, mb: int, last_used_s: float, evictable: bool = True) -> Resident:
    return Resident(name, mb * 1024 * 1024, last_used_s, evictable)


MB = 1024 * 1024


def test_a_load_that_fits_evicts_nothing() -> None:
    plan = plan_eviction([resident("a", 100, 0.0)], need_bytes=100 * MB, budget_bytes=200 * MB)
    assert plan.evict == ()
    assert plan.fits
    assert plan.free_bytes == 100 * MB


def test_eviction_takes_least_recently_used_first_and_only_as_many_as_needed() -> None:
    residents = [resident("new", 100, 30.0), resident("old", 100, 10.0), resident("mid", 100, 20.0)]
    plan = plan_eviction(residents, need_bytes=150 * MB, budget_bytes=350 * MB)
    assert plan.evict == ("old",)
    assert plan.fits
    plan = plan_eviction(residents, need_bytes=200 * MB, budget_bytes=350 * MB)
    assert plan.evict == ("old", "mid")
    assert plan.fits


def test_eviction_passes_over_models_that_cannot_go() -> None:
    residents = [resident("busy", 100, 0.0, evictable=False), resident("idle", 100, 50.0)]
    plan = plan_eviction(residents, need_bytes=100 * MB, budget_bytes=200 * MB)
    assert plan.evict == ("idle",)
    assert plan.fits


def test_eviction_reports_when_nothing_makes_room() -> None:
    residents = [resident("busy", 100, 0.0, evictable=False), resident("idle", 50, 1.0)]
    plan = plan_eviction(residents, need_bytes=120 * MB, budget_bytes=200 * MB)
    assert not plan.fits
    assert plan.free_bytes == 50 * MB


def test_folder_bytes_sums_the_files_below(tmp_path: Path) -> None:
    (tmp_path / "1" / "sub").mkdir(parents=True)
    (tmp_path / "1" / "model.onnx").write_bytes(b"x" * 1000)
    (tmp_path / "1" / "sub" / "tokenizer.json").write_bytes(b"y" * 24)
    assert folder_bytes([tmp_path / "1"]) == 1024
    assert folder_bytes([]) == 0


async def test_a_platforms_libraries_are_imported_before_its_load_is_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(memory.PLATFORM_LIBRARIES, "fake", ("json", "no_such_module_anywhere"))
    monkeypatch.delitem(sys.modules, "json")
    await import_libraries("fake")  # a missing one is left to the load to report
    assert "json" in sys.modules
    await import_libraries("echo")  # none to import


def test_mib_is_readable() -> None:
    assert mib(512 * 1024) == "0.5"
    assert mib(300 * MB) == "300"


def test_lifecycle_table_is_read_from_config() -> None:
    text = 'platform = "echo"\n[lifecycle]\nidle_unload_s = 300\nload_timeout_s = 5\n'
    config = msgspec.toml.decode(text, type=ModelConfig)
    assert config.lifecycle == LifecycleSettings(idle_unload_s=300.0, load_timeout_s=5.0)
    assert msgspec.toml.decode('platform = "echo"', type=ModelConfig).lifecycle.idle_unload_s == 0


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        (LifecycleSettings(idle_unload_s=-1.0), "idle_unload_s"),
        (LifecycleSettings(idle_unload_s=float("nan")), "idle_unload_s"),
        (LifecycleSettings(load_timeout_s=0.0), "load_timeout_s"),
        (LifecycleSettings(load_timeout_s=float("inf")), "load_timeout_s"),
    ],
)
def test_bad_lifecycle_values_are_refused_by_name(settings: LifecycleSettings, key: str) -> None:
    with pytest.raises(ConfigError, match=f"lifecycle.{key}"):
        validate_lifecycle(settings)
    config = ModelConfig(name="m", platform="echo", lifecycle=settings)
    with pytest.raises(ConfigError, match=f"lifecycle.{key}"):
        validate(config)


def test_unknown_lifecycle_key_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match="idle_unload"):
        msgspec.toml.decode('platform = "echo"\n[lifecycle]\nidle_unload = 3\n', type=ModelConfig)
