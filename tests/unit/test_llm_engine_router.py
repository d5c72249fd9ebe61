"""The pure parts of data-parallel engine processes: the router (least loaded, prefix affinity
within a slack, dead processes skipped, a bounded affinity table), the gauges of N processes
shown as one, the `num_engine_processes` key and the load-time machine checks."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from fulcrum.errors import ConfigError
from fulcrum.llm.engine_group import check_cores, check_memory, threads_per_process
from fulcrum.llm.engine_group_metrics import ChildMetrics, GaugeTable
from fulcrum.llm.engine_router import ChildLoad, Router, affinity_slack, least_loaded
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.params import EngineParams

BLOCK = 4
LABELS = {"model": "m", "version": "1", "variant": "default"}


def _loads(*num_requests: int | None) -> list[ChildLoad | None]:
    return [None if n is None else ChildLoad(n, 10 * n) for n in num_requests]


def _prompt(first: int, length: int = 8) -> list[int]:
    return [first] * BLOCK + list(range(100, 100 + length - BLOCK))


def test_least_loaded_counts_requests_then_tokens_then_index() -> None:
    assert least_loaded(_loads(3, 1, 2)) == 1
    assert least_loaded([ChildLoad(2, 50), ChildLoad(2, 40)]) == 1  # fewer prompt tokens
    assert least_loaded([ChildLoad(2, 40), ChildLoad(2, 40)]) == 0  # a tie: the first
    assert least_loaded(_loads(None, 5, None)) == 1  # a dead process takes nothing
    assert least_loaded(_loads(None, None)) is None


def test_a_new_prefix_goes_to_the_least_loaded_and_sticks_within_the_slack() -> None:
    router = Router(BLOCK, slack=2)
    assert router.route(_prompt(7), None, _loads(1, 0)) == 1  # new: least loaded
    # Same first block, other questions after it: the same process while within the slack.
    assert router.route(_prompt(7, 12), None, _loads(0, 1)) == 1
    assert router.route(_prompt(7), None, _loads(0, 2)) == 1
    # Past the slack (3 more than the least loaded): balance wins, and the affinity moves.
    assert router.route(_prompt(7), None, _loads(0, 3)) == 0
    assert router.route(_prompt(7), None, _loads(1, 0)) == 0


def test_other_prefixes_and_salts_route_by_load_alone() -> None:
    router = Router(BLOCK, slack=8)
    assert router.route(_prompt(7), None, _loads(0, 0)) == 0
    assert router.route(_prompt(8), None, _loads(1, 0)) == 1  # another first block
    # The same tokens under another cache salt share no cache: no affinity to process 0.
    assert router.route(_prompt(7), "tenant-b", _loads(1, 0)) == 1
    assert router.route(_prompt(7), None, _loads(1, 0)) == 0  # the unsalted one still sticks


def test_a_prompt_shorter_than_a_block_has_no_affinity() -> None:
    router = Router(BLOCK, slack=8)
    assert router.route([7, 7, 7], None, _loads(0, 0)) == 0
    assert router.route([7, 7, 7], None, _loads(1, 0)) == 1
    assert router.num_keys == 0


def test_a_dead_process_is_skipped_and_forgotten() -> None:
    router = Router(BLOCK, slack=8)
    assert router.route(_prompt(7), None, _loads(1, 0)) == 1
    assert router.route(_prompt(7), None, _loads(0, None)) == 0  # its affine process is down
    assert router.route(_prompt(7), None, _loads(None, None)) is None
    router.route(_prompt(9), None, _loads(1, 0))  # -> 1
    router.forget_child(1)  # it restarted with an empty cache
    assert router.route(_prompt(9), None, _loads(0, 0)) == 0  # by load again


def test_the_affinity_table_is_bounded() -> None:
    router = Router(BLOCK, slack=8, max_keys=3)
    for first in range(5):
        router.route(_prompt(first), None, _loads(0, 0))
    assert router.num_keys == 3
    assert router.route(_prompt(0), None, _loads(1, 0)) == 1  # the oldest was dropped
    assert router.route(_prompt(4), None, _loads(1, 0)) == 0  # the newest is kept


def test_the_slack_is_a_share_of_a_full_batch() -> None:
    assert affinity_slack(256) == 32
    assert affinity_slack(1) == 1
    with pytest.raises(ValueError):
        Router(0, slack=1)


def test_gauges_sum_counts_and_average_shares_over_live_processes() -> None:
    registry = CollectorRegistry()
    metrics = LLMMetrics(registry, "m", 1)
    table = GaugeTable(metrics, 2)
    first, second = ChildMetrics(metrics, table, 0), ChildMetrics(metrics, table, 1)
    first.running.set(3)
    second.running.set(5)
    first.kv_usage.set(0.2)
    second.kv_usage.set(0.6)
    first.generation_tokens.inc(4)  # counters and histograms are the model's own
    second.generation_tokens.inc(6)
    second.ttft_s.observe(0.1)
    second.request_finished("length")
    value = registry.get_sample_value
    assert value("fulcrum_llm_num_requests_running", LABELS) == 8
    assert value("fulcrum_llm_kv_cache_usage_perc", LABELS) == pytest.approx(0.4)
    assert value("fulcrum_llm_generation_tokens_total", LABELS) == 10
    assert value("fulcrum_llm_time_to_first_token_seconds_count", LABELS) == 1
    finished = {**LABELS, "finished_reason": "length"}
    assert value("fulcrum_llm_request_success_total", finished) == 1
    table.clear(1)  # the second process died: it holds nothing now
    assert value("fulcrum_llm_num_requests_running", LABELS) == 3
    assert value("fulcrum_llm_kv_cache_usage_perc", LABELS) == pytest.approx(0.2)
    second.remove()  # a process's view never drops the model's series
    assert value("fulcrum_llm_num_requests_running", LABELS) == 3
    table.clear(0)
    assert value("fulcrum_llm_num_requests_running", LABELS) == 0
    assert table.value("running") is None


@pytest.mark.parametrize("value", [0, -2, True, "2", 1.5])
def test_num_engine_processes_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(ConfigError, match=r"parameters\.num_engine_processes"):
        EngineParams.from_parameters({"num_engine_processes": value})


def test_num_engine_processes_implies_a_process_and_contradicts_an_explicit_thread() -> None:
    assert not EngineParams().uses_process
    assert EngineParams.from_parameters({"num_engine_processes": 2}).uses_process
    assert EngineParams.from_parameters({"engine_process": True}).uses_process
    with pytest.raises(ConfigError, match=r"num_engine_processes' = 2.*engine_process is false"):
        EngineParams.from_parameters({"num_engine_processes": 2, "engine_process": False})


def test_more_processes_than_the_machine_holds_is_refused_naming_the_key() -> None:
    check_cores(2, 2)
    with pytest.raises(ConfigError, match=r"num_engine_processes' = 3: .* 2 CPU cores"):
        check_cores(3, 2)
    mib = 1024 * 1024
    check_memory(3, 100 * mib, 250 * mib)  # two more of 100 MiB fit
    check_memory(3, None, 1)  # unknown: no check
    with pytest.raises(ConfigError, match=r"num_engine_processes' = 3: .*200 MiB, more than"):
        check_memory(3, 100 * mib, 150 * mib)


def test_threads_per_process_share_the_cores_but_the_servers() -> None:
    assert threads_per_process(0, 2, 2) == 1
    assert threads_per_process(0, 1, 2) == 1  # as one engine process today
    assert threads_per_process(0, 2, 16) == 7
    assert threads_per_process(0, 4, 4) == 1
    assert threads_per_process(3, 2, 2) == 3  # as set
