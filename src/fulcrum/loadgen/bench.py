"""`run_bench`: prepare requests from the server's metadata, sweep load levels, search, report."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable
from pathlib import Path

import msgspec

from fulcrum.client import Endpoint
from fulcrum.errors import InvalidInput
from fulcrum.loadgen import server_stats
from fulcrum.loadgen.arrivals import ARRIVAL_KINDS, ArrivalKind
from fulcrum.loadgen.closed_loop import run_closed_loop
from fulcrum.loadgen.driver import PerfTimer, PointHooks, Target
from fulcrum.loadgen.kserve import V2Inputs, V2Target, fetch_metadata, prepare_v2
from fulcrum.loadgen.llm import LlmInputs, LlmTarget, prepare_llm
from fulcrum.loadgen.open_loop import run_open_loop
from fulcrum.loadgen.results import BenchRun, Mode, PointResult, summarize_point
from fulcrum.loadgen.row_stream import V2StreamTarget
from fulcrum.loadgen.search import max_rate_under
from fulcrum.loadgen.stats import Slo, parse_slo
from fulcrum.loadgen.windows import MeasurePlan, WindowStats


class BenchOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one `fulcrum bench` run needs."""

    model: str
    url: str = "http://127.0.0.1:8000"
    concurrency: tuple[int, ...] = ()
    rates: tuple[float, ...] = ()
    arrivals: ArrivalKind = "poisson"
    burstiness: float = 1.0
    plan: MeasurePlan = MeasurePlan()
    slos: tuple[str, ...] = ()
    max_rate_under: str | None = None  # e.g. "p99=100ms"
    search_start_rate: float = 16.0
    openai: bool = False
    v2: V2Inputs = V2Inputs()
    llm: LlmInputs = LlmInputs()
    timeout_s: float = 30.0
    max_in_flight: int = 1024
    seed: int = 0
    label: str = ""
    out: Path | None = None


PointCallback = Callable[[PointResult], None]
WindowCallback = Callable[[str, WindowStats], None]


class _Hooks(PointHooks):
    """Snapshots the server's statistics around the measurement and reports windows."""

    def __init__(
        self, endpoint: Endpoint, options: BenchOptions, label: str, on_window: WindowCallback
    ):
        self.endpoint = endpoint
        self.options = options
        self.label = label
        self._on_window = on_window
        self.before: server_stats.StatsSnapshot | None = None
        self.after: server_stats.StatsSnapshot | None = None

    def on_window(self, window: WindowStats) -> None:
        self._on_window(self.label, window)

    async def on_measure_start(self) -> None:
        if not self.options.openai:
            self.before = await server_stats.snapshot(self.endpoint, self.options.model)

    async def on_measure_end(self) -> None:
        if not self.options.openai:
            self.after = await server_stats.snapshot(self.endpoint, self.options.model)


def _validate(options: BenchOptions) -> list[Slo]:
    if options.arrivals not in ARRIVAL_KINDS:
        raise InvalidInput(f"arrivals {options.arrivals!r}: expected one of {ARRIVAL_KINDS}")
    if any(c < 1 for c in options.concurrency) or any(r <= 0 for r in options.rates):
        raise InvalidInput("concurrency levels must be >= 1 and rates > 0")
    slos = [parse_slo(text) for text in options.slos]
    if options.max_rate_under is not None:
        slos.insert(0, parse_slo(options.max_rate_under))
    return slos


class Bench:
    """One run: a prepared target, then points measured one after another."""

    def __init__(self, options: BenchOptions, target: Target, slos: list[Slo]) -> None:
        self.options = options
        self.endpoint = Endpoint.from_url(options.url)
        self.target = target
        self.slos = slos
        self.on_point: PointCallback = lambda _: None
        self.on_window: WindowCallback = lambda _label, _window: None

    @classmethod
    async def prepare(cls, options: BenchOptions) -> Bench:
        """Read the model's metadata (v2) and prebuild every request body."""
        slos = _validate(options)
        endpoint = Endpoint.from_url(options.url)
        target: Target
        if options.openai:
            target = LlmTarget(endpoint, prepare_llm(endpoint, options.model, options.llm))
        else:
            meta = await fetch_metadata(endpoint, options.model)
            requests = prepare_v2(endpoint, meta, options.v2)
            stream = options.v2.stream_rows
            target = V2StreamTarget(endpoint, requests) if stream else V2Target(endpoint, requests)
        return cls(options, target, slos)

    async def point(self, mode: Mode, level: float) -> PointResult:
        """Measure one concurrency level or request rate."""
        options = self.options
        label = f"c={level:g}" if mode == "concurrency" else f"{level:g} rps"
        hooks = _Hooks(self.endpoint, options, label, self.on_window)
        timer = PerfTimer()
        if mode == "concurrency":
            raw = await run_closed_loop(
                self.target,
                int(level),
                options.plan,
                timer,
                timeout_s=options.timeout_s,
                hooks=hooks,
            )
        else:
            raw = await run_open_loop(
                self.target,
                level,
                options.plan,
                timer,
                arrivals=options.arrivals,
                burstiness=options.burstiness,
                seed=options.seed,
                max_in_flight=options.max_in_flight,
                timeout_s=options.timeout_s,
                hooks=hooks,
            )
        split = server_stats.split(hooks.before, hooks.after)
        result = summarize_point(
            mode, level, raw, self.slos, split,
            llm=options.openai, stream_rows=options.v2.stream_rows and not options.openai,
        )  # fmt: skip
        self.on_point(result)
        return result

    async def run(self) -> BenchRun:
        """The sweep (closed loop levels, then rates), then the search if asked."""
        options = self.options
        run = BenchRun(
            model=options.model,
            url=options.url,
            label=options.label or options.model,
            api="openai" if options.openai else "v2",
            batch_size=options.v2.batch_size,
            stream_rows=options.v2.stream_rows and not options.openai,
            arrivals=options.arrivals if options.rates or options.max_rate_under else "",
            slos=[str(s) for s in self.slos],
            started_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        )
        levels = list(options.concurrency)
        if not levels and not options.rates and options.max_rate_under is None:
            levels = [1]
        for level in levels:
            run.points.append(await self.point("concurrency", level))
        for rate in options.rates:
            run.points.append(await self.point("rate", rate))
        if options.max_rate_under is not None:
            found = await max_rate_under(
                lambda rate: self.point("rate", rate), start_rate=options.search_start_rate
            )
            run.points.extend(found.points)
            run.max_rate_under = found.best_rate
            run.search_bound = options.max_rate_under
        return run


async def run_bench_async(
    options: BenchOptions,
    *,
    on_point: PointCallback | None = None,
    on_window: WindowCallback | None = None,
) -> BenchRun:
    """Run a benchmark inside an existing event loop; with `options.out`, save it there."""
    bench = await Bench.prepare(options)
    if on_point is not None:
        bench.on_point = on_point
    if on_window is not None:
        bench.on_window = on_window
    run = await bench.run()
    if options.out is not None:
        save_run(run, options.out)
    return run


def save_run(run: BenchRun, out_dir: Path) -> list[Path]:
    """results.json, results.csv and the plots into `out_dir`; their paths."""
    from fulcrum.loadgen.plots import write_plots
    from fulcrum.loadgen.report import write_run

    return write_run(run, out_dir) + write_plots([run], out_dir)


def run_bench(options: BenchOptions, *, progress: bool = False) -> BenchRun:
    """Run a benchmark on a fresh uvloop event loop (the client's CPU cost matters)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        if not progress:
            return runner.run(run_bench_async(options))
        from fulcrum.loadgen.progress import BenchProgress

        with BenchProgress(options.plan.max_duration_s) as bar:
            coro = run_bench_async(options, on_point=bar.on_point, on_window=bar.on_window)
            return runner.run(coro)
