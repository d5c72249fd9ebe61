"""`fulcrum profile`'s measurement: a model's backend run directly (no HTTP) on fixed inputs over
batch sizes 1, 2, 4, ... and input lengths; per point latency, throughput, memory and CPU, with the
tokenizer timed apart from the graph; then the knee and the memory bound. `measure` is the API
`fulcrum quantize` calls for each variant."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from fulcrum.backends import Backend, create_backend
from fulcrum.backends.text import TextFrontEnd
from fulcrum.config import ModelConfig
from fulcrum.errors import InvalidInput, ModelError
from fulcrum.tuning.knee import MemoryBound, find_knee, is_flat, memory_bound
from fulcrum.tuning.profile_inputs import InputMaker, has_dynamic_dims
from fulcrum.tuning.resources import (
    MIB,
    Nvml,
    ResourceMonitor,
    Usage,
    available_memory_mb,
    machine_description,
)
from fulcrum.types import TensorMap


@dataclass(frozen=True)
class ProfileOptions:
    """What to sweep and how long to measure each point."""

    batch_sizes: tuple[int, ...] = ()  # (): 1, 2, 4, ... up to max_batch
    max_batch: int = 0  # 0: the model's max_batch_size
    lengths: tuple[int, ...] = (16, 64, 256)  # tokens (text) or -1 dims; unused with samples
    warmup: int = 2  # unmeasured runs per point
    repeats: int = 10  # measured runs per point (fewer when max_seconds_per_point runs out)
    max_seconds_per_point: float = 10.0
    knee_margin: float = 0.10  # a doubling that gains less throughput than this is flat
    backoff: float = 0.20  # the knee rule backs off this fraction from the saturation batch
    stop_at_knee: bool = True  # stop doubling at the first flat step (the procedure's rule)
    memory_budget_mb: float | None = None  # None: the memory available when profiling starts
    seed: int = 0

    def check(self) -> None:
        """InvalidInput naming the first bad option."""
        if any(b < 1 for b in self.batch_sizes) or self.max_batch < 0:
            raise InvalidInput("batch sizes must be >= 1 (and max batch >= 0)")
        if any(n < 1 for n in self.lengths):
            raise InvalidInput(f"lengths must be >= 1, got {list(self.lengths)}")
        if self.warmup < 0 or self.repeats < 1 or self.max_seconds_per_point <= 0:
            raise InvalidInput("warm-up must be >= 0, repeats >= 1 and seconds per point > 0")
        if self.memory_budget_mb is not None and self.memory_budget_mb <= 0:
            raise InvalidInput(f"memory budget must be > 0 MB, got {self.memory_budget_mb}")


class ProfilePoint(msgspec.Struct, frozen=True, kw_only=True):
    """One (batch size, length) point; times in ms, throughput in rows/s at the median."""

    batch_size: int
    length: int  # requested tokens (text) or -1 dims; 0: fixed shapes or the caller's samples
    num_tokens: int  # the token width the tokenizer produced (text); else the length
    num_runs: int
    latency_ms_p50: float  # tokenizer + model
    latency_ms_p99: float
    throughput_rps: float
    encode_ms_p50: float | None  # the text front end; None: the model takes tensors
    model_ms_p50: float
    model_ms_p99: float
    rss_mb_peak: float  # peak resident memory above the process's before the model loaded
    cpu_util: float  # process CPU time / wall / usable cores
    gpu_util_pct: float | None = None  # None: not measured (no GPU or no pynvml)
    gpu_mem_mb_peak: float | None = None
    gpu_power_w: float | None = None


class ProfileResult(msgspec.Struct, kw_only=True):
    """Every point, and the figures the knee rule and the memory bound derive from them."""

    model: str
    variant: str = ""
    version: str = ""
    platform: str
    machine: str
    headline_length: int  # the length the knee, memory bound and latency_ms_b1 come from
    points: list[ProfilePoint]
    latency_ms_b1: float | None  # median latency of one row (None: batch 1 not measured)
    saturation_batch: int
    saturated: bool  # False: throughput still grew at the largest batch measured
    knee_batch: int
    knee_throughput_rps: float
    memory_bound_batch: int | None
    memory: MemoryBound | None = None
    gpu_memory_bound_batch: int | None = None
    notes: list[str] = []

    def to_json(self) -> str:
        """Indented JSON of the whole result."""
        return msgspec.json.format(msgspec.json.encode(self).decode(), indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> ProfileResult:
        return msgspec.json.decode(text, type=cls)


def sweep_batch_sizes(config: ModelConfig, options: ProfileOptions) -> tuple[int, ...]:
    """The batch sizes to measure: the options' list, or 1, 2, 4, ... and the limit itself.
    The limit may exceed max_batch_size: finding the right max_batch_size is the point."""
    if config.max_batch_size == 0:
        if options.batch_sizes not in ((), (1,)) or options.max_batch > 1:
            raise InvalidInput(f"model {config.name!r} does not batch (max_batch_size = 0)")
        return (1,)
    if options.batch_sizes:
        return tuple(sorted(set(options.batch_sizes)))
    limit = options.max_batch or config.max_batch_size
    sizes = [1]
    while sizes[-1] * 2 <= limit:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != limit:
        sizes.append(limit)
    return tuple(sizes)


def measure(
    config: ModelConfig,
    version_dir: Path,
    options: ProfileOptions,
    *,
    samples: TensorMap | None = None,
) -> ProfileResult:
    """Load `config`'s backend (a resolved variant's config) from `version_dir` and profile it.
    `samples`: the rows to use (N rows, tiled or cut to each batch size) instead of generated."""
    options.check()
    if config.platform == "llm":
        raise InvalidInput(
            f"model {config.name!r} is an LLM: use fulcrum.tuning.profile_llm.measure_llm"
        )
    nvml = Nvml.open()
    try:
        monitor = ResourceMonitor(nvml)  # before the load: points then include the weights
        backend = create_backend(config, version_dir)
        try:
            result = profile_backend(
                backend,
                config,
                options,
                monitor=monitor,
                samples=samples,
                model_size_mb=_folder_mb(version_dir),
            )
        finally:
            backend.close()
    finally:
        nvml.close()
    result.version = version_dir.name
    return result


def profile_backend(
    backend: Backend,
    config: ModelConfig,
    options: ProfileOptions,
    *,
    monitor: ResourceMonitor,
    samples: TensorMap | None = None,
    model_size_mb: float = 0.0,
) -> ProfileResult:
    """Profile a loaded backend; `monitor`'s baseline should predate the load."""
    options.check()
    budget_mb = options.memory_budget_mb or available_memory_mb()
    sweep = _Sweep(backend, config, options, monitor, samples)
    batch_sizes = sweep_batch_sizes(config, options)
    lengths = sweep.lengths()
    for length in lengths:  # longest first: see _Sweep.lengths
        sweep.run_length(length, batch_sizes)
    headline = lengths[0]
    if not sweep.at(headline):
        raise ModelError(f"model {config.name!r}: no point could be measured: {sweep.notes}")
    knee = find_knee(
        [(p.batch_size, p.throughput_rps) for p in sweep.at(headline)],
        margin=options.knee_margin,
        backoff=options.backoff,
    )
    knee_point = sweep.point_at(knee.batch, headline)
    memory = memory_bound(
        [(p.batch_size, p.rss_mb_peak) for p in sweep.at(headline)],
        budget_mb,
        weights_mb=model_size_mb,
    )
    b1 = next((p for p in sweep.at(headline) if p.batch_size == 1), None)
    return ProfileResult(
        model=config.name,
        platform=config.platform,
        machine=machine_description(monitor.nvml),
        headline_length=headline,
        points=sorted(sweep.points, key=lambda p: (p.length, p.batch_size)),
        latency_ms_b1=None if b1 is None else b1.latency_ms_p50,
        saturation_batch=knee.saturation_batch,
        saturated=knee.saturated,
        knee_batch=knee.batch,
        knee_throughput_rps=0.0 if knee_point is None else knee_point.throughput_rps,
        memory_bound_batch=None if memory is None else memory.max_batch,
        memory=memory,
        gpu_memory_bound_batch=_gpu_bound(sweep.at(headline), monitor.nvml),
        notes=[*sweep.notes, *_notes(knee.saturated, memory, monitor.nvml, batch_sizes)],
    )


class _Sweep:
    """The points measured so far and how to measure one more."""

    def __init__(
        self,
        backend: Backend,
        config: ModelConfig,
        options: ProfileOptions,
        monitor: ResourceMonitor,
        samples: TensorMap | None,
    ) -> None:
        self.backend = backend
        self.config = config
        self.options = options
        self.monitor = monitor
        # ONNX and torch backends expose their text front end; the profile runs it itself, so
        # the tokenizer and the graph are timed apart (both backends take pre-encoded tokens).
        front = getattr(backend, "front", None)
        self.front = front if isinstance(front, TextFrontEnd) else None
        self.samples = samples
        self.inputs = InputMaker(config, self.front, samples=samples, seed=options.seed)
        self.points: list[ProfilePoint] = []
        self.notes: list[str] = []

    def lengths(self) -> tuple[int, ...]:
        """Longest first. ONNX Runtime's CPU arena keeps the most it ever allocated, so a point
        reads the memory of the largest batch x length run before it: sweeping the longest
        length first, batches ascending, keeps the headline length's memory figures its own
        (shorter lengths then read at most the headline's). The arena is left on, as served."""
        if self.samples is not None or not (self.front or has_dynamic_dims(self.config)):
            return (0,)
        return tuple(sorted(set(self.options.lengths), reverse=True))

    def at(self, length: int) -> list[ProfilePoint]:
        return sorted((p for p in self.points if p.length == length), key=lambda p: p.batch_size)

    def run_length(self, length: int, batch_sizes: tuple[int, ...]) -> None:
        """Measure batch sizes in order; stop at the first flat doubling (when told to)."""
        for batch_size in batch_sizes:
            point = self.measure_point(batch_size, length)
            if point is None:
                return
            done = self.at(length)
            if (
                self.options.stop_at_knee
                and len(done) > 1
                and is_flat(done[-2].throughput_rps, point.throughput_rps, self.options.knee_margin)
            ):
                return

    def point_at(self, batch_size: int, length: int) -> ProfilePoint | None:
        """The point (batch_size, length), measured now if it was not (the backed-off knee)."""
        found = next((p for p in self.at(length) if p.batch_size == batch_size), None)
        return found if found is not None else self.measure_point(batch_size, length)

    def measure_point(self, batch_size: int, length: int) -> ProfilePoint | None:
        """One point, or None (and a note) when the backend failed at it, e.g. out of memory."""
        try:
            point = self._measure(batch_size, length)
        except ModelError as exc:
            self.notes.append(f"batch {batch_size} at length {length} failed: {exc.message}")
            return None
        self.points.append(point)
        return point

    def _measure(self, batch_size: int, length: int) -> ProfilePoint:
        rows = self.inputs.rows(batch_size, length)
        num_tokens = self._num_tokens(rows, length)
        for _ in range(self.options.warmup):
            self._run_once(rows)
        encode_s: list[float] = []
        model_s: list[float] = []
        deadline = time.perf_counter() + self.options.max_seconds_per_point
        self.monitor.start()
        try:
            while len(model_s) < self.options.repeats:
                encoding, running = self._run_once(rows)
                encode_s.append(encoding)
                model_s.append(running)
                if time.perf_counter() >= deadline:
                    break
        finally:
            usage = self.monitor.stop()
        rows_per_batch = batch_size if self.config.max_batch_size > 0 else 1
        return _point(rows_per_batch, length, num_tokens, encode_s, model_s, usage, self.front)

    def _run_once(self, rows: TensorMap) -> tuple[float, float]:
        """(encode s, model s) of one run of the batch."""
        start = time.perf_counter()
        feeds = rows
        if self.front is not None:
            feeds = dict(rows)
            feeds.update(self.front.encode(feeds.pop(self.front.spec.input)))
        encoded = time.perf_counter()
        self.backend.execute(feeds)
        return encoded - start, time.perf_counter() - encoded

    def _num_tokens(self, rows: TensorMap, length: int) -> int:
        if self.front is None or self.front.spec.input not in rows:
            return length
        ids = self.front.encode(rows[self.front.spec.input])[self.front.spec.ids]
        return int(ids.shape[-1])


def _point(
    batch_size: int,
    length: int,
    num_tokens: int,
    encode_s: list[float],
    model_s: list[float],
    usage: Usage,
    front: TextFrontEnd | None,
) -> ProfilePoint:
    latency_ms = (np.asarray(encode_s) + np.asarray(model_s)) * 1000
    model_ms = np.asarray(model_s) * 1000
    p50 = float(np.percentile(latency_ms, 50))
    gpu = usage.gpu
    return ProfilePoint(
        batch_size=batch_size,
        length=length,
        num_tokens=num_tokens,
        num_runs=len(model_s),
        latency_ms_p50=p50,
        latency_ms_p99=float(np.percentile(latency_ms, 99)),
        throughput_rps=batch_size / (p50 / 1000) if p50 > 0 else 0.0,
        encode_ms_p50=float(np.percentile(encode_s, 50)) * 1000 if front is not None else None,
        model_ms_p50=float(np.percentile(model_ms, 50)),
        model_ms_p99=float(np.percentile(model_ms, 99)),
        rss_mb_peak=usage.rss_mb_peak,
        cpu_util=usage.cpu_util,
        gpu_util_pct=None if gpu is None else gpu.util_pct,
        gpu_mem_mb_peak=None if gpu is None else gpu.mem_mb_peak,
        gpu_power_w=None if gpu is None else gpu.power_w,
    )


def _gpu_bound(points: list[ProfilePoint], nvml: Nvml) -> int | None:
    figures = [(p.batch_size, p.gpu_mem_mb_peak) for p in points if p.gpu_mem_mb_peak is not None]
    if not nvml.available or len(figures) < 2:
        return None
    bound = memory_bound([(b, float(m)) for b, m in figures], nvml.total_memory_mb())
    return None if bound is None else bound.max_batch


def _notes(
    saturated: bool, memory: MemoryBound | None, nvml: Nvml, batch_sizes: tuple[int, ...]
) -> list[str]:
    notes: list[str] = []
    if not saturated:
        notes.append(
            f"throughput still grew at batch {batch_sizes[-1]}: the knee lies beyond the sweep "
            "(raise --max-batch)"
        )
    if memory is None:
        notes.append("memory bound: not computed (needs two batch sizes)")
    elif memory.max_batch is None:
        notes.append("memory bound: memory did not grow with the batch; it bounds nothing here")
    if not nvml.available:
        notes.append(f"GPU: {nvml.note}")
    return notes


def _folder_mb(folder: Path) -> float:
    """Size of a version folder's files: the weights' stand-in when the memory fit has none."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / MIB
