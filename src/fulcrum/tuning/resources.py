"""What a profile point costs the machine: peak resident memory above a baseline, CPU utilisation,
and GPU utilisation, memory and power through NVML when a GPU and `pynvml` are present."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulcrum.extras import require

MIB = 1024 * 1024
# Sampling period of the RSS/NVML thread: short enough to catch a batch's peak, long enough that
# the sampler's own CPU time stays far below the model's. On Linux the kernel's high-water mark
# (VmHWM) catches the peaks between samples anyway.
SAMPLE_INTERVAL_S = 0.01
_PROC_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class GpuUsage:
    """NVML figures over one point, summed over the visible GPUs (utilisation: the busiest)."""

    util_pct: float  # mean of the samples
    mem_mb_peak: float  # device memory in use above the monitor's baseline (all processes)
    power_w: float  # mean of the samples


@dataclass(frozen=True)
class Usage:
    """What one point cost: memory above the baseline, CPU share, and the GPU when measured."""

    rss_mb_peak: float
    cpu_util: float  # process CPU time / wall time / usable cores: 1.0 = every core busy
    gpu: GpuUsage | None


def _psutil() -> Any:
    return require("tune", "psutil", feature="fulcrum profile (memory figures)")


@functools.cache
def _this_process() -> Any:
    return _psutil().Process()


def rss_mb() -> float:
    """This process's resident memory now."""
    return float(_this_process().memory_info().rss) / MIB


def _live_rss_mb() -> float:
    """Resident memory after collecting garbage and handing freed heap back to the system
    (glibc's `malloc_trim`): a baseline that garbage freed later would otherwise undercut (a
    process that served models before, as a test run does, can free more than a model's
    weights while the next one loads)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc only; elsewhere the RSS as it is
    return rss_mb()


def available_memory_mb() -> float:
    """Memory the machine can still give without swapping."""
    return float(_psutil().virtual_memory().available) / MIB


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not every core of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _reset_peak_rss() -> bool:
    """Reset the kernel's resident high-water mark (Linux >= 4.0); False where unsupported."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _kernel_peak_rss_mb() -> float | None:
    try:
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class Nvml:
    """The visible GPUs through NVML, or the reason there are none (`note`)."""

    def __init__(self, module: Any, handles: list[Any], note: str) -> None:
        self.module = module
        self.handles = handles
        self.note = note

    @classmethod
    def open(cls) -> Nvml:
        """NVML when `pynvml` (package nvidia-ml-py) imports and finds a GPU; else a note."""
        try:
            import pynvml  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            return cls(None, [], "not measured: no GPU (pynvml is not installed)")
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except pynvml.NVMLError as exc:  # no driver, no device: the usual case on a CPU host
            return cls(None, [], f"not measured: no GPU ({exc})")
        if not handles:
            pynvml.nvmlShutdown()
            return cls(None, [], "not measured: no GPU")
        return cls(pynvml, handles, "")

    @property
    def available(self) -> bool:
        return bool(self.handles)

    def names(self) -> list[str]:
        return [str(self.module.nvmlDeviceGetName(h)) for h in self.handles]

    def sample(self) -> tuple[float, float, float]:
        """(utilisation % of the busiest GPU, MB in use, W drawn) over the visible GPUs."""
        nvml = self.module
        util = max(float(nvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in self.handles)
        used = sum(float(nvml.nvmlDeviceGetMemoryInfo(h).used) for h in self.handles) / MIB
        power = sum(_power_w(nvml, h) for h in self.handles)
        return util, used, power

    def total_memory_mb(self) -> float:
        nvml = self.module
        return sum(float(nvml.nvmlDeviceGetMemoryInfo(h).total) for h in self.handles) / MIB

    def close(self) -> None:
        if self.available:
            self.module.nvmlShutdown()
            self.handles = []


def _power_w(nvml: Any, handle: Any) -> float:
    try:
        return float(nvml.nvmlDeviceGetPowerUsage(handle)) / 1000  # mW
    except nvml.NVMLError:  # some boards do not report power
        return 0.0


class ResourceMonitor:
    """Measures points one at a time: `start()`, run the point, `stop()` -> Usage. The baseline
    is the process's RSS (and the GPUs' memory) when the monitor is made: make it before the
    model loads, so a point's figure is weights + runtime + that batch's working memory."""

    def __init__(self, nvml: Nvml | None = None, *, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.nvml = nvml or Nvml(None, [], "not measured: GPU monitoring off")
        self.interval_s = interval_s
        self.baseline_mb = _live_rss_mb()
        self.gpu_baseline_mb = self.nvml.sample()[1] if self.nvml.available else 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peak_mb = 0.0
        self._gpu_samples: list[tuple[float, float, float]] = []
        self._kernel_peak = False
        self._started = (0.0, 0.0)  # (wall, process CPU) seconds at start

    def start(self) -> None:
        """Begin a point: reset the peaks and start the sampling thread."""
        if self._thread is not None:
            raise RuntimeError("ResourceMonitor.start() called twice without stop()")
        self._kernel_peak = _reset_peak_rss()
        self._peak_mb = rss_mb()
        self._gpu_samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample_loop, name="profile-sampler")
        self._started = (time.perf_counter(), time.process_time())
        self._thread.start()

    def stop(self) -> Usage:
        """End the point: join the sampler and summarise what it saw."""
        wall_s = time.perf_counter() - self._started[0]
        cpu_s = time.process_time() - self._started[1]
        thread, self._thread = self._thread, None
        if thread is None:
            raise RuntimeError("ResourceMonitor.stop() called before start()")
        self._stop.set()
        thread.join()
        self._sample()
        peak = self._peak_mb
        if self._kernel_peak:
            peak = max(peak, _kernel_peak_rss_mb() or 0.0)
        # Capped at 1: over a point of a few ms the kernel's per-thread CPU accounting can
        # read a little above wall x cores, which no process can really use.
        cpu_util = min(1.0, cpu_s / wall_s / usable_cores()) if wall_s > 0 else 0.0
        return Usage(max(0.0, peak - self.baseline_mb), cpu_util, self._gpu_usage())

    def _sample_loop(self) -> None:
        # A periodic sampler is the one place a timed wait is the design: the event ends it.
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        self._peak_mb = max(self._peak_mb, rss_mb())
        if self.nvml.available:
            self._gpu_samples.append(self.nvml.sample())

    def _gpu_usage(self) -> GpuUsage | None:
        samples = self._gpu_samples
        if not samples:
            return None
        return GpuUsage(
            util_pct=sum(s[0] for s in samples) / len(samples),
            mem_mb_peak=max(0.0, max(s[1] for s in samples) - self.gpu_baseline_mb),
            power_w=sum(s[2] for s in samples) / len(samples),
        )


def machine_description(nvml: Nvml | None = None) -> str:
    """One line naming the CPU, its usable cores, the memory and the GPUs (or "no GPU")."""
    cpu = _cpu_model() or platform.processor() or platform.machine()
    total_gib = float(_psutil().virtual_memory().total) / (1024 * MIB)
    gpus = ", ".join(nvml.names()) if nvml is not None and nvml.available else "no GPU"
    return f"{cpu}, {usable_cores()} cores, {total_gib:.1f} GiB; {gpus}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return ""
    return ""
