"""`fulcrum tune`'s measurer: reload the model with a candidate's override, then load it.

The reload is Triton's `POST /v2/repository/models/{m}/load` with `parameters.config` (the
server lays it over the file's config at top level); a reload the server refuses is a failed
trial, not a failed run. Each candidate gets a fresh `Bench` (the metadata may change with the
batching), then `max_rate_under` (or one point at `--rate`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import msgspec

from fulcrum.client import ClientError, Connection, Endpoint, build_request, get_json
from fulcrum.config import ModelConfig
from fulcrum.errors import ConfigError, InvalidInput
from fulcrum.loadgen.bench import Bench, BenchOptions
from fulcrum.loadgen.report import batch_size
from fulcrum.loadgen.results import PointResult
from fulcrum.loadgen.search import max_rate_under
from fulcrum.loadgen.stats import PERCENTILES, Slo, parse_slo
from fulcrum.loadgen.windows import MeasurePlan
from fulcrum.protocol.metadata import model_config_json
from fulcrum.tuning.ranking import RatePoint, TrialFigures
from fulcrum.tuning.search_space import Candidate, override_for
from fulcrum.tuning.tune import Measured, TuneOptions

RELOAD_TIMEOUT_S = 600.0  # a big model's load; the server answers when the new one serves
MIN_RATE_DIVISOR = 8.0  # the rate search goes no lower than its start / 8


class _BelowFloor(Exception):
    """The rate search went below its floor: stop it there."""


def slo_value_ms(point: PointResult, slo: Slo) -> float:
    """The SLO's metric at its percentile (per-request forms: the worst request)."""
    pct = 100.0 if slo.percentile is None else slo.percentile
    if slo.metric == "latency":
        return point.latency.percentile_ms(pct)
    if point.llm is None:
        raise InvalidInput(f"SLO {slo} needs streamed LLM figures (an llm model)")
    summary = point.llm.ttft if slo.metric == "ttft" else point.llm.tpot
    return summary.percentile_ms(pct)


def check_slos(slos: Sequence[Slo], *, llm: bool) -> None:
    """Refuse SLOs this run cannot judge, before any reload."""
    for slo in slos:
        if slo.percentile is not None and slo.percentile not in PERCENTILES:
            raise InvalidInput(f"SLO {slo}: use a reported percentile {PERCENTILES}")
        if slo.metric != "latency" and not llm:
            raise InvalidInput(f"SLO {slo}: ttft and tpot apply to llm models only")


def _failure(point: PointResult, slos: Sequence[Slo]) -> str:
    """Why a point broke its SLOs: each bound broken, and the errors."""
    broken = [
        f"{slo} broken: {value:.1f} ms"
        for slo in slos
        if (value := slo_value_ms(point, slo)) > slo.bound_ms
    ]
    if point.errors:
        errors = ", ".join(f"{k}:{v}" for k, v in sorted(point.errors.items()))
        broken.append(f"errors {errors}")
    return f"at {point.level:g} rps: " + ("; ".join(broken) or "SLO not met")


class LiveMeasurer:
    """Reloads and measures candidates on one server; `restore` serves the file again."""

    def __init__(
        self,
        config: ModelConfig,
        bench: BenchOptions,
        *,
        rate_rps: float | None = None,
        search_start_rps: float = 16.0,
        search_steps: int = 6,
        search_tolerance: float = 0.1,
        admin_token: str = "",
    ) -> None:
        self.config = config
        self.bench = bench
        self.slos = [parse_slo(text) for text in bench.slos]
        check_slos(self.slos, llm=bench.openai)
        if rate_rps is not None and not rate_rps > 0:
            raise InvalidInput(f"--rate {rate_rps}: must be > 0")
        self.rate_rps = rate_rps
        self.search_start_rps = search_start_rps
        self.search_steps = search_steps
        self.search_tolerance = search_tolerance
        self.endpoint = Endpoint.from_url(bench.url)
        self.admin_token = admin_token

    @classmethod
    def from_options(cls, options: TuneOptions, config: ModelConfig) -> LiveMeasurer:
        """A measurer for `options` (windows of `point_s`, LLM models over the OpenAI API)."""
        if options.point_s <= 0 or options.warmup_s < 0:
            raise InvalidInput("--point-seconds must be > 0 and --warmup >= 0")
        plan = MeasurePlan(
            warmup_s=options.warmup_s, window_s=options.point_s / 3, max_duration_s=options.point_s
        )
        bench = BenchOptions(
            model=options.model, url=options.url, plan=plan, slos=options.slos,
            openai=config.platform == "llm", v2=options.v2, llm=options.llm,
            timeout_s=options.timeout_s, seed=options.seed, label=options.model,
        )  # fmt: skip
        return cls(
            config, bench, rate_rps=options.rate_rps, search_start_rps=options.search_start_rps,
            search_steps=options.search_steps, search_tolerance=options.search_tolerance,
            admin_token=options.admin_token,
        )  # fmt: skip

    async def reload(self, changes: dict[str, object]) -> None:
        """Reload the model: with the override for `changes`, or (empty) as its file says."""
        body: dict[str, object] = {}
        if changes:
            override = override_for(self.config, changes)
            body = {"parameters": {"config": msgspec.json.encode(override).decode()}}
        headers = {"Content-Type": "application/json"}
        if self.admin_token:
            headers["Authorization"] = f"Bearer {self.admin_token}"
        path = f"/v2/repository/models/{self.bench.model}/load"
        raw = build_request(
            self.endpoint, "POST", path, headers=headers, body=msgspec.json.encode(body)
        )
        connection = Connection(self.endpoint)
        try:
            response = await connection.request(raw, timeout_s=RELOAD_TIMEOUT_S)
        finally:
            connection.close()
        if response.status in (403, 404):
            # Not the candidate's fault: no admin token, or no such model on this server.
            raise ClientError(f"POST {path}: HTTP {response.status}: {_error_text(response.body)}")
        if not 200 <= response.status < 300:
            raise ReloadRefused(_error_text(response.body), status=response.status)

    async def restore(self) -> None:
        """Serve the file's config again (reload without override)."""
        await self.reload({})

    async def measure(
        self, candidate: Candidate, changes: dict[str, object], *, start_rate_rps: float | None
    ) -> Measured:
        """Reload with `changes`, then find the highest rate holding the SLO (or try `--rate`)."""
        try:
            await self.reload(changes)
        except ReloadRefused as exc:
            if not changes:  # the file's own config: without it there is nothing to compare
                raise ConfigError(
                    f"model '{self.config.name}' fails to load: {exc.message}"
                ) from exc
            return Measured(figures=None, reasons=(f"reload refused: {exc.message}",))
        if not changes:
            await self._check_serves_file()
        bench = await Bench.prepare(self.bench)
        if self.rate_rps is not None:
            points = [await bench.point("rate", self.rate_rps)]
        else:
            points = await self._search(bench, max(self.search_start_rps, start_rate_rps or 0.0))
        return self._verdict(points)

    async def _search(self, bench: Bench, start_rps: float) -> list[PointResult]:
        """`max_rate_under` from `start_rps`, but never below `start_rps / MIN_RATE_DIVISOR`: a
        config failing that far down has lost already, and a point of a few requests per
        second holds too few requests for a percentile."""
        points: list[PointResult] = []
        floor_rps = start_rps / MIN_RATE_DIVISOR

        async def evaluate(rate: float) -> PointResult:
            if rate < floor_rps:
                raise _BelowFloor
            point = await bench.point("rate", rate)
            points.append(point)
            return point

        with contextlib.suppress(_BelowFloor):
            await max_rate_under(
                evaluate,
                start_rate=start_rps,
                rel_tolerance=self.search_tolerance,
                max_steps=self.search_steps,
            )
        return points

    async def _check_serves_file(self) -> None:
        """The server reloaded without override must serve --repository's config.toml; a
        different repository would make every override and the --apply diff wrong."""
        served = await get_json(self.endpoint, f"/v2/models/{self.bench.model}/config")
        expected = model_config_json(self.config)  # the same Triton-shaped JSON the server sends
        keys = ("max_batch_size", "dynamic_batching", "instance_group")
        found = {k: served.get(k) for k in keys} if isinstance(served, dict) else {}
        if found != {k: expected.get(k) for k in keys}:
            raise ConfigError(
                f"the server's '{self.config.name}' is not the one in --repository ({found} "
                "served): point --repository at the server's model repository"
            )

    def _verdict(self, points: list[PointResult]) -> Measured:
        held = [p for p in points if p.slo_met]
        chosen = max(held, key=lambda p: p.level) if held else min(points, key=lambda p: p.level)
        reasons = () if held else (_failure(chosen, self.slos),)
        searched = self.rate_rps is None and bool(held)
        unbounded = searched and not any(p.level > chosen.level for p in points)
        return Measured(
            figures=self._figures(chosen, lower_bound=unbounded),
            reasons=reasons,
            points=tuple(self._rate_point(p) for p in points),
        )

    def _figures(self, point: PointResult, *, lower_bound: bool) -> TrialFigures:
        return TrialFigures(
            rate_rps=point.level,
            goodput_rps=point.goodput_rps or 0.0,
            throughput_rps=point.throughput_rps,
            rows_per_s=point.rows_per_s,
            latency_ms=slo_value_ms(point, self.slos[0]),
            p50_ms=point.latency.p50_ms,
            p99_ms=point.latency.p99_ms,
            mean_batch_size=batch_size(point),
            errors=dict(point.errors),
            rate_is_lower_bound=lower_bound,
        )

    def _rate_point(self, point: PointResult) -> RatePoint:
        return RatePoint(
            rate_rps=point.level,
            goodput_rps=point.goodput_rps or 0.0,
            throughput_rps=point.throughput_rps,
            latency_ms=slo_value_ms(point, self.slos[0]),
            slo_met=bool(point.slo_met),
        )


class ReloadRefused(ClientError):
    """The server answered the load request with an error (the candidate is at fault)."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def _error_text(body: bytes) -> str:
    """The server's `{"error": ...}` message, else the start of the body."""
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body[:200].decode("utf-8", "replace")
    if isinstance(decoded, dict) and isinstance(decoded.get("error"), str):
        return str(decoded["error"])
    return body[:200].decode("utf-8", "replace")
