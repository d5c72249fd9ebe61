"""The Ray path's pure parts, without a cluster: statistics and metrics merging, the context on
the wire, the handle-call bounds and error mapping, the autoscaling policy, the stats hub, the
`[scale]` table and the deployment options it makes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.config import load_model_config
from fulcrum.context import RequestContext
from fulcrum.errors import ConfigError, DeadlineExceeded, NotFound, Unavailable
from fulcrum.ray.aggregate import ReplicaSnapshot, merge_metrics, sum_statistics
from fulcrum.ray.app import deployment_options, folder_version, parse_args
from fulcrum.ray.autoscale import (
    BUSY,
    LATENCY,
    ONGOING,
    QUEUE_DELAY,
    REFUSED,
    Counters,
    Load,
    SloPolicy,
    Targets,
    Window,
    desired_replicas,
    load_of,
    window_signals,
)
from fulcrum.ray.forward import CallPolicy, classify, forward
from fulcrum.ray.hub import StatsHub
from fulcrum.ray.wire import from_wire, to_wire
from fulcrum.stats import ModelStats

# --- statistics and metrics ------------------------------------------------------------------


def replica_rows(num_requests: int, batch_sizes: list[int]) -> list[dict[str, object]]:
    stats = ModelStats()
    for _ in range(num_requests):
        stats.record_success(1, 0.010, 0.002, 0.005)
    for size in batch_sizes:
        stats.record_execution(size, 0.005)
    return [stats.to_json("echo", 1)]


def test_statistics_sum_counters_and_merge_batch_sizes() -> None:
    rows = sum_statistics([replica_rows(3, [1, 2]), replica_rows(5, [2, 4])])
    assert len(rows) == 1
    row = rows[0]
    assert row["name"] == "echo" and row["version"] == "1"
    assert row["inference_count"] == 8 and row["execution_count"] == 4
    success = row["inference_stats"]["success"]  # type: ignore[index]
    assert success == {"count": 8, "ns": 8 * 10_000_000}
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in row["batch_stats"]}  # type: ignore[index, union-attr]
    assert sizes == {1: 1, 2: 2, 4: 1}
    assert len(row["replicas"]) == 2  # type: ignore[arg-type]


def test_the_lone_session_state_is_kept_per_replica_not_summed() -> None:
    first, second = replica_rows(1, [1]), replica_rows(1, [1])
    first[0]["lone_session"] = [{"favourite": "spinning", "runs": {"spinning": 7, "instance": 1}}]
    second[0]["lone_session"] = [{"favourite": "instance", "runs": {"spinning": 2, "instance": 9}}]
    [row] = sum_statistics([first, second])
    assert "lone_session" not in row
    favourites = [r["lone_session"][0]["favourite"] for r in row["replicas"]]  # type: ignore[union-attr, index]
    assert favourites == ["spinning", "instance"]


def test_statistics_keep_versions_apart_and_do_not_alias_inputs() -> None:
    first = replica_rows(1, [1])
    second = [dict(first[0], version="2")]
    rows = sum_statistics([first, second, replica_rows(2, [1])])
    assert [(r["version"], r["inference_count"]) for r in rows] == [("1", 3), ("2", 1)]
    assert first[0]["inference_count"] == 1  # the replica's own row is left as it was


def replica_metrics(num: int, latency_s: float) -> str:
    registry = CollectorRegistry()
    requests = Counter("fulcrum_requests", "requests", ["model"], registry=registry)
    histogram = Histogram("fulcrum_request_seconds", "latency", ["model"], registry=registry)
    for _ in range(num):
        requests.labels("echo").inc()
        histogram.labels("echo").observe(latency_s)
    return generate_latest(registry).decode()


def test_metrics_keep_each_replica_as_a_labelled_series_that_sums() -> None:
    text = merge_metrics({"a": replica_metrics(3, 0.004), "b": replica_metrics(2, 0.2)}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    count = [s for s in families["fulcrum_request_seconds"].samples if s.name.endswith("_count")]
    assert {s.labels["replica"]: s.value for s in count} == {"a": 3.0, "b": 2.0}
    buckets = [
        s for s in families["fulcrum_request_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["le"] == "0.005"
    ]  # fmt: skip
    assert sum(s.value for s in buckets) == 3.0  # `sum without (replica)` of one bucket
    assert text.count("# TYPE fulcrum_request_seconds histogram") == 1


# --- the context across processes ------------------------------------------------------------


def test_context_deadline_and_age_cross_clocks_as_durations() -> None:
    ctx = RequestContext("r1", "t", "v2", deadline_s=1000.5, received_s=999.0, priority=2)
    wire = to_wire(ctx, now_s=1000.0)
    assert wire.ctx.deadline_s is None and wire.ctx.received_s is None
    there = from_wire(wire, now_s=5.0)  # another machine's monotonic clock
    assert there.deadline_s == pytest.approx(5.5)
    assert there.received_s == pytest.approx(4.0)
    assert there.priority == 2 and there.request_id == "r1"
    untimed = from_wire(to_wire(dataclasses.replace(ctx, deadline_s=None), 1000.0), 5.0)
    assert untimed.deadline_s is None


# --- handle calls ----------------------------------------------------------------------------


class ActorDiedError(Exception):
    """Named as Ray's: `forward` classifies Ray's errors by class name."""


class RayTaskError(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class FakeResponse:
    """A `DeploymentResponse` stand-in: an awaitable answer that records its cancellation."""

    def __init__(self, outcome: object, delay_s: float = 0.0) -> None:
        self.outcome = outcome
        self.delay_s = delay_s
        self.cancelled = False

    def __await__(self) -> Any:
        return self._run().__await__()

    async def _run(self) -> object:
        if self.delay_s:
            await asyncio.Event().wait()  # never answers: only the bound ends the wait
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def cancel(self) -> None:
        self.cancelled = True


async def test_lost_replica_is_retried_once_then_answers() -> None:
    outcomes = [FakeResponse(ActorDiedError("gone")), FakeResponse("ok")]
    sent = iter(outcomes)
    answer = await forward(lambda: next(sent), CallPolicy(), what="m", deadline_s=None)
    assert answer == "ok"


async def test_lost_replica_twice_is_a_503() -> None:
    policy = CallPolicy(retry_lost=True)
    with pytest.raises(Unavailable) as err:
        await forward(lambda: FakeResponse(ActorDiedError("x")), policy, what="m", deadline_s=None)
    assert err.value.status_code == 503


async def test_not_retried_when_not_idempotent() -> None:
    calls: list[FakeResponse] = []

    def send() -> FakeResponse:
        calls.append(FakeResponse(ActorDiedError("x")))
        return calls[-1]

    with pytest.raises(Unavailable):
        await forward(send, CallPolicy(retry_lost=False), what="m", deadline_s=None)
    assert len(calls) == 1


async def test_replica_error_comes_back_as_itself() -> None:
    wrapped = RayTaskError(NotFound("model 'x' is not loaded"))
    with pytest.raises(NotFound, match="not loaded"):
        await forward(lambda: FakeResponse(wrapped), CallPolicy(), what="m", deadline_s=None)


async def test_silent_replica_is_cancelled_at_the_deadline() -> None:
    response = FakeResponse("never", delay_s=1.0)
    with pytest.raises(DeadlineExceeded):
        await forward(lambda: response, CallPolicy(timeout_s=60.0), what="m", deadline_s=0.01)
    assert response.cancelled


def test_unknown_failure_is_a_500_without_internals() -> None:
    error = classify(RuntimeError("secret path /x"), "m")
    assert error.status_code == 500 and "secret" not in error.message


# --- autoscaling -----------------------------------------------------------------------------


def test_window_signals_are_the_windows_means() -> None:
    before = Counters(10, 10 * 20_000_000, 10 * 5_000_000, compute_ns=0)
    after = Counters(
        14, before.request_ns + 4 * 100_000_000, before.queue_ns + 4 * 60_000_000,
        compute_ns=500_000_000,
    )  # fmt: skip
    window = Window(elapsed_s=1.0, num_instances=2, num_queued=0, predicted_s=0.3, num_ongoing=3)
    signals = window_signals(before, after, window)
    assert signals[LATENCY] == pytest.approx(0.1)  # nothing queued: the answers' mean
    assert signals[QUEUE_DELAY] == pytest.approx(0.06)
    assert signals[ONGOING] == 3.0
    assert signals[BUSY] == pytest.approx(0.25)  # 0.5 s of batches over 2 instances x 1 s
    stuck = window_signals(after, after, Window(elapsed_s=1.0, num_queued=5, predicted_s=0.3))
    assert stuck[LATENCY] == pytest.approx(0.3)  # a queue and no answer: the prediction
    idle = window_signals(after, after, Window(elapsed_s=1.0))
    assert idle[LATENCY] == 0.0 and idle[BUSY] == 0.0


def test_load_takes_the_worst_time_signal_against_its_target() -> None:
    targets = Targets(slo_s=0.1, queue_delay_s=0.025)
    metrics = {LATENCY: {"a": 0.05, "b": 0.07}, QUEUE_DELAY: {"a": 0.05, "b": 0.05}}
    assert load_of(targets, metrics).pressure == pytest.approx(2.0)
    no_slo = load_of(Targets(ongoing_per_replica=4.0), {ONGOING: {"a": 8.0, "b": 4.0}})
    assert no_slo.pressure == pytest.approx(1.5)


def test_refusals_count_as_demand_the_replicas_could_not_take() -> None:
    before = Counters(100, 100 * 50_000_000, 0, num_refused=10)
    after = Counters(150, before.request_ns + 50 * 50_000_000, 0, num_refused=60)
    signals = window_signals(before, after, Window(elapsed_s=1.0))
    assert signals[REFUSED] == pytest.approx(0.5)
    # Answered well within the SLO (the batch policy shed the rest): the refusals still say 2x.
    metrics = {LATENCY: {"r": 0.05}, REFUSED: {"r": 0.5}}
    assert load_of(Targets(slo_s=0.15), metrics).pressure == pytest.approx(2.0)
    calm = {LATENCY: {"r": 0.05}, REFUSED: {"r": 0.01}}
    assert load_of(Targets(slo_s=0.15), calm).pressure < 1.0


@pytest.mark.parametrize(
    ("current", "pressure", "busy", "num_requests", "expected"),
    [
        (2, 3.0, 1.0, 10, 6),  # over the targets: in proportion
        (2, 1.1, 1.0, 10, 3),  # at least one more
        (3, 0.7, 0.6, 10, 3),  # busy as targeted: hold
        (4, 0.5, 0.15, 10, 1),  # surplus: towards the target busy share
        (3, 0.9, 0.9, 10, 3),  # busy above target but within the SLO: never up on busy alone
        (1, 0.1, 0.01, 1, 1),  # requests in flight: never below one
        (1, 0.0, 0.0, 0, 0),  # idle: to zero (Serve keeps min_replicas)
        (0, 0.0, 0.0, 3, 1),  # from zero on the first request
    ],
)
def test_desired_replicas(
    current: int, pressure: float, busy: float, num_requests: int, expected: int
) -> None:
    load = Load(pressure, busy)
    assert desired_replicas(current, load, num_requests=num_requests) == expected


def test_slo_policy_reads_serves_context() -> None:
    policy = SloPolicy(slo_ms=100, queue_delay_ms=25)
    ctx = SimpleNamespace(
        aggregated_metrics={LATENCY: {"r1": 0.3}, QUEUE_DELAY: {"r1": 0.01}, BUSY: {"r1": 1.0}},
        current_num_replicas=1, total_num_requests=12, policy_state={"kept": 1},
    )  # fmt: skip
    num, state = policy(ctx)
    assert num == 3 and state["kept"] == 1 and state["fulcrum_pressure"] == pytest.approx(3.0)


# --- the stats hub ---------------------------------------------------------------------------


def snapshot(replica: str, model: str = "echo") -> ReplicaSnapshot:
    return ReplicaSnapshot(replica, model, [], "")


async def test_hub_wakes_every_poller_and_forgets_the_silent() -> None:
    hub = StatsHub(poll_s=5.0)

    async def replica(name: str, answers: bool) -> None:
        epoch = await hub.poll(name, "echo", 0)
        if answers:
            await hub.answer(epoch, snapshot(name))

    pollers = [asyncio.ensure_future(replica(n, n != "dead")) for n in ("a", "b", "dead")]
    await asyncio.sleep(0)  # let each poller register
    got = await hub.collect("echo", timeout_s=0.2)
    assert sorted(s.replica for s in got) == ["a", "b"]
    assert sorted(await hub.replicas()) == ["a", "b"]  # "dead" did not answer: forgotten
    await asyncio.gather(*pollers)


async def test_hub_collects_one_model_only() -> None:
    hub = StatsHub(poll_s=5.0)

    async def replica(name: str, model: str) -> None:
        epoch = await hub.poll(name, model, 0)
        await hub.answer(epoch, snapshot(name, model))

    tasks = [asyncio.ensure_future(replica("a", "echo")), asyncio.ensure_future(replica("b", "x"))]
    await asyncio.sleep(0)
    got = await hub.collect("x", timeout_s=1.0)
    assert [s.replica for s in got] == ["b"]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# --- [scale] and the deployment options --------------------------------------------------------

ECHO = """
platform = "echo"
max_batch_size = 8
[[inputs]]
name = "x"
datatype = "FP32"
shape = [4]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [4]
[dynamic_batching]
policy = "adaptive"
slo_p99_ms = 80
"""


def write_model(tmp_path: Path, scale: str) -> Path:
    model = tmp_path / "echo"
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "config.toml").write_text(ECHO + scale)
    return model / "config.toml"


def test_fixed_replicas_and_resources_from_scale(tmp_path: Path) -> None:
    config = load_model_config(
        write_model(tmp_path, "[scale]\nmin_replicas = 3\nmax_replicas = 3\nnum_cpus = 0.5\n"),
        dir_name="echo",
    )
    options = deployment_options(config)
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}
    assert options["max_ongoing_requests"] >= 8  # above a full batch


def test_autoscaling_targets_come_from_the_slo(tmp_path: Path) -> None:
    text = "[scale]\nmin_replicas = 0\nmax_replicas = 4\n"
    config = load_model_config(write_model(tmp_path, text), dir_name="echo")
    autoscaling = deployment_options(config)["autoscaling_config"]
    assert (autoscaling["min_replicas"], autoscaling["max_replicas"]) == (0, 4)
    assert autoscaling["policy"]["policy_function"] == "fulcrum.ray.autoscale:SloPolicy"
    kwargs = autoscaling["policy"]["policy_kwargs"]
    assert kwargs["slo_ms"] == 80 and kwargs["queue_delay_ms"] == 20


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ("min_replicas = 3\nmax_replicas = 2", "scale.max_replicas"),
        ("min_replicas = -1", "scale.min_replicas"),
        ("min_replicas = 1\nmax_replicas = 3\ninitial_replicas = 5", "scale.initial_replicas"),
        ("num_cpus = nan", "scale.num_cpus"),
        ("slo_ms = -5", "scale.slo_ms"),
        ("replicas = 2", "replicas"),
    ],
)
def test_bad_scale_is_refused_naming_the_key(tmp_path: Path, table: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_model_config(write_model(tmp_path, f"[scale]\n{table}\n"), dir_name="echo")


def test_folder_version_changes_with_the_config_and_new_versions(tmp_path: Path) -> None:
    path = write_model(tmp_path, "")
    first = folder_version(path.parent)
    assert folder_version(path.parent) == first
    (path.parent / "2").mkdir()
    (path.parent / "2" / "weights.bin").write_bytes(b"w")
    second = folder_version(path.parent)
    path.write_text(path.read_text() + "\n[scale]\nmax_replicas = 2\n")
    assert len({first, second, folder_version(path.parent)}) == 3


def test_builder_arguments_from_strings() -> None:
    args = parse_args({"repository": "models", "models": "a, b", "request_timeout_s": "5"})
    assert args.request_timeout_s == 5.0
    assert args.model_names(Path("/nonexistent")) == ["a", "b"]
    with pytest.raises(ConfigError, match="app_builder"):
        parse_args({"repository": "models", "replicas": "2"})
    with pytest.raises(ConfigError, match="request_timeout_s"):
        parse_args({"repository": "models", "request_timeout_s": "0"})


def test_example_serve_config_is_valid_for_serve_deploy() -> None:
    import yaml
    from ray.serve.schema import ServeDeploySchema

    path = Path(__file__).resolve().parents[2] / "examples" / "ray-serve.yaml"
    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    (application,) = schema.applications
    assert application.import_path == "fulcrum.ray:app_builder"
    assert parse_args(application.args).repository == "/srv/models"


def test_serve_logs_no_traceback_for_an_overload_answer_but_does_for_a_failure() -> None:
    from fulcrum.errors import ModelError, Shed
    from fulcrum.ray.replica import quiet_expected_errors

    def record(error: Exception) -> logging.LogRecord:
        return logging.LogRecord("ray.serve", logging.ERROR, "f", 1, "Request failed.", None,
                                 (type(error), error, None))  # fmt: skip

    assert not quiet_expected_errors(record(Shed("cannot finish in time")))
    assert not quiet_expected_errors(record(NotFound("no model")))
    assert quiet_expected_errors(record(ModelError("the model raised")))
    assert quiet_expected_errors(record(RuntimeError("a bug")))


def test_serve_accepts_the_builder_and_every_deployment_option(tmp_path: Path) -> None:
    """What `serve run fulcrum.ray:app_builder repository=...` does before it deploys: Serve
    validates the options of every deployment (autoscaling included) as it builds the graph."""
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from fulcrum.ray import app_builder

    write_model(tmp_path, "[scale]\nmin_replicas = 0\nmax_replicas = 3\n")
    app = call_user_app_builder_with_args_if_necessary(app_builder, {"repository": str(tmp_path)})
    assert isinstance(app, Application)
    with pytest.raises(ConfigError, match="not a folder"):
        app_builder({"repository": str(tmp_path / "missing")})


def test_without_ray_the_builder_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from fulcrum import extras
    from fulcrum.ray import app_builder

    real = importlib.import_module

    def without_ray(name: str, package: str | None = None) -> Any:
        if name.partition(".")[0] == "ray":
            raise ModuleNotFoundError(f"No module named {name!r}", name="ray")
        return real(name, package)

    monkeypatch.setattr(extras.importlib, "import_module", without_ray)
    with pytest.raises(ConfigError, match=r"pip install 'fulcrum-serve\[ray\]'"):
        app_builder({"repository": "models"})
