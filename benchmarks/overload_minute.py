"""Three times capacity for a minute: issue 11's acceptance run for overload.

    .venv/bin/python benchmarks/overload_minute.py [--factor 3] [--seconds 60] [--slo-ms 100]
        [--configs shipped,adaptive,triton] [--out /tmp/overload] [--compute-nice 0,2,5 --repeats 2]

One `fulcrum serve --model minilm` process. Capacity (under Triton's rules, which refuse nothing
before the queue is full) is measured open loop, as the overload is sent: Poisson steps from 0.2x
to 1.4x the closed-loop rate (32 clients), and capacity is the highest rate whose step answered at
least 99% of its requests, all within 1 s. Then, per config (the shipped one; `policy = "adaptive"`
with the SLO; `triton`: Triton's rules; each loaded by a reload override and warmed 5 s at 30%):
`--factor` x capacity, Poisson, for `--seconds`, while a prober process GETs /v2/health/live and
/ready 20 times a second on its own connection, and the server's RSS is sampled. Printed per
config, in the issue's terms: goodput (answers within the SLO per second) as a share of capacity,
the admitted P99, how many got 503 and how fast, client timeouts and other errors (nothing may be
lost: offered = answered + 503 + the rest), health P99, and RSS before, at the peak and 10 s after
the load stopped. Figures also go to --out as JSON.
With several `--compute-nice` values, each gets its own server (`fulcrum serve --compute-nice N`),
interleaved round after round for `--repeats` rounds, all at the capacity measured first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from adaptive_vs_static import (
    adaptive_override,
    build_repository,
    capacity_rps,
    run_async,
    v2_requests,
)
from health_under_flood import probed, serving, summary
from load_trace import (
    Step,
    arrival_times,
    open_loop_capacity,
    policy_state,
    reload,
    replay,
    settle,
)

from fulcrum.client import Endpoint
from fulcrum.demo_bench import under_triton_rules
from fulcrum.loadgen.kserve import V2Target
from fulcrum.loadgen.records import STATUS_TIMEOUT, RequestRecord

MODEL = "minilm"
PROBE_HZ = 20.0


@dataclass
class Outcome:
    """One config under the overload."""

    config: str
    compute_nice: int
    repeat: int
    offered: int
    answered: int
    good: int
    shed: int
    timed_out: int
    other: int
    goodput_share: float  # good per second / capacity
    admitted_p99_ms: float
    shed_p99_ms: float
    # The same two from the moment the request was really sent: the generator shares the
    # machine's two cores and falls behind its schedule at this rate (client_lag_p99_ms).
    admitted_sent_p99_ms: float
    shed_sent_p99_ms: float
    client_lag_p99_ms: float
    health_p99_ms: float
    health_bad: int
    rss_before_mb: float
    rss_peak_mb: float
    rss_after_mb: float
    # CPU over the overload, in cores (2 = all of this machine): the server, split by thread
    # name, and this process (the load generator), which a production server would not share
    # its cores with; per request in microseconds.
    server_cores: float = 0.0
    generator_cores: float = 0.0
    server_threads_cores: dict[str, float] | None = None
    server_us_per_request: float = 0.0
    generator_us_per_request: float = 0.0
    other_statuses: dict[int, int] | None = None  # what "other" was, by status (<0: no HTTP)
    other_errors: list[str] | None = None  # the distinct messages of "other" (up to 5)
    # The adaptive policy's counters over the overload (statistics API): refused for their
    # deadline (on arrival, from the request head, or late: admitted, then shed at the head of
    # the queue, which is what makes a slow 503).
    policy_counts: dict[str, float] | None = None
    thread_nices: dict[str, list[int]] | None = None  # the server's, by thread name
    # [voluntary, involuntary] context switches per second over the overload, by thread name
    thread_switches_per_s: dict[str, list[int]] | None = None
    # requests sent a second time, not counted in `other`: the server closed their idle
    # keep-alive connection before any byte of an answer (fulcrum.client.ClosedUnanswered)
    retried: int = 0


def p99_ms(records: list[RequestRecord], of: str = "latency") -> float:
    """P99 in ms of each record's latency (from its scheduled time), `sent` (from when it was
    really sent) or `lag` (how late it was sent)."""
    if not records:
        return float("nan")
    value = {
        "latency": lambda r: r.latency_s,
        "sent": lambda r: r.done_s - r.sent_s,
        "lag": lambda r: r.lag_s,
    }[of]
    values = sorted(value(r) * 1e3 for r in records)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def policy_counts(before: object, after: object) -> dict[str, float] | None:
    """The policy's counters gained between two statistics states, and its state after."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return None
    counters = ("shed_deadline", "shed_head", "shed_late", "probes", "batches_observed",
                "speed_changes")  # fmt: skip
    gained = {f"+{k}": after[k] - before.get(k, 0) for k in counters if k in after}
    kept = ("batch_limit", "queue_bound", "arrival_margin", "arrival_age_ms",
            "overhead_reserve_ms", "batch_fixed_ms", "batch_row_ms", "batch_error")  # fmt: skip
    return {**gained, **{k: round(after[k], 2) for k in kept if k in after}}


def server_process(port: int) -> psutil.Process:
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "serve" in cmdline and str(port) in cmdline:
            return proc
    raise RuntimeError(f"no server process listening on port {port}")


def thread_cpu_s(proc: psutil.Process) -> dict[str, float]:
    """CPU seconds per thread of `proc`: "main" (the event loop), else by name, threads of one
    name summed (ORT's pool and the executor threads are all "python")."""
    out: dict[str, float] = {}
    for thread in proc.threads():
        if thread.id == proc.pid:
            name = "main"
        else:
            try:
                name = Path(f"/proc/{proc.pid}/task/{thread.id}/comm").read_text().strip()
            except OSError:  # the thread ended between the two reads
                continue
        out[name] = out.get(name, 0.0) + thread.user_time + thread.system_time
    return out


def thread_nices(proc: psutil.Process) -> dict[str, list[int]]:
    """The nice values of the server's threads by thread name (as thread_cpu_s names them): a
    check that --compute-nice lowered the compute threads and left the event loop alone."""
    out: dict[str, set[int]] = {}
    for thread in proc.threads():
        try:
            name = (
                "main"
                if thread.id == proc.pid
                else Path(f"/proc/{proc.pid}/task/{thread.id}/comm").read_text().strip()
            )
            out.setdefault(name, set()).add(os.getpriority(os.PRIO_PROCESS, thread.id))
        except OSError:  # the thread ended between the two reads
            continue
    return {name: sorted(values) for name, values in out.items()}


def thread_switches(proc: psutil.Process) -> dict[str, list[int]]:
    """[voluntary, involuntary] context switches per thread name: involuntary ones are
    preemptions (a compute thread preempted mid-run holds its partner at ORT's barrier)."""
    out: dict[str, list[int]] = {}
    for thread in proc.threads():
        task = Path(f"/proc/{proc.pid}/task/{thread.id}")
        try:
            name = "main" if thread.id == proc.pid else (task / "comm").read_text().strip()
            lines = (task / "status").read_text().splitlines()
        except OSError:  # the thread ended between the reads
            continue
        counts = dict(line.split(":\t") for line in lines if "ctxt_switches" in line)
        total = out.setdefault(name, [0, 0])
        total[0] += int(counts["voluntary_ctxt_switches"])
        total[1] += int(counts["nonvoluntary_ctxt_switches"])
    return out


class CpuAccount:
    """CPU seconds the server (per thread name) and this process spend between enter and exit."""

    def __init__(self, server: psutil.Process) -> None:
        self.server = server
        self.me = psutil.Process()
        self.seconds = 0.0
        self.server_s = self.generator_s = 0.0
        self.threads_s: dict[str, float] = {}
        self.switches_per_s: dict[str, list[int]] = {}

    def __enter__(self) -> CpuAccount:
        self._t0 = time.perf_counter()
        self._server0 = sum(self.server.cpu_times()[:2])
        self._me0 = sum(self.me.cpu_times()[:2])
        self._threads0 = thread_cpu_s(self.server)
        self._switches0 = thread_switches(self.server)
        return self

    def __exit__(self, *_: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.server_s = sum(self.server.cpu_times()[:2]) - self._server0
        self.generator_s = sum(self.me.cpu_times()[:2]) - self._me0
        after = thread_cpu_s(self.server)
        self.threads_s = {k: v - self._threads0.get(k, 0.0) for k, v in after.items()}
        zero = [0, 0]
        self.switches_per_s = {  # a thread that ended in between is left out
            k: [round((v[i] - self._switches0.get(k, zero)[i]) / self.seconds) for i in (0, 1)]
            for k, v in thread_switches(self.server).items()
        }

    def cores(self, cpu_s: float) -> float:
        return cpu_s / self.seconds if self.seconds > 0 else 0.0


def py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    """py-spy recording the server (threads, GIL holders only) for `seconds`, raw format."""
    exe = os.environ.get("PY_SPY", "/tmp/tools/bin/py-spy")
    if not Path(exe).exists():
        print(f"  no py-spy at {exe}: not profiled", flush=True)
        return None
    cmd = [exe, "record", "--pid", str(pid), "--threads", "--gil", "-f", "raw", "-r", "100",
           "--nonblocking", "-d", str(max(1, int(seconds))), "-o", str(out)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class RssSampler:
    """The server's resident memory, sampled every 0.25 s on a thread; the peak seen."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now_mb(self) -> float:
        return float(self.proc.memory_info().rss) / 2**20

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self.peak_mb = max(self.peak_mb, self.now_mb())


def play(url: str, target: V2Target, steps: list[Step], rate: float, seed: int,
         timeout_s: float) -> list[RequestRecord]:  # fmt: skip
    offsets = arrival_times(steps, rate, seed)
    run = run_async(replay(target, steps, offsets, url=url, model=MODEL, timeout_s=timeout_s))
    run_async(settle(url, MODEL))
    return run.records


def overload(url: str, port: int, target: V2Target, name: str, override: dict[str, object] | None,
             capacity: float, args: argparse.Namespace,
             run: tuple[int, int]) -> Outcome:  # fmt: skip
    """One config at `--factor` x capacity; `run`: (compute_nice, repeat), for the record."""
    reload(url, MODEL, override)
    play(url, target, [Step(0.0, 5.0, 0.3)], capacity, seed=99, timeout_s=10.0)
    proc = server_process(port)
    sampler = RssSampler(proc)
    before = sampler.now_mb()
    prober, pipe = probed(port, PROBE_HZ, args.seconds)
    spy_path = args.out / f"{name}.nice{run[0]}.r{run[1]}.pyspy.txt"
    spy = py_spy(proc.pid, args.seconds, spy_path) if args.py_spy else None
    policy_before = policy_state(url, MODEL)
    retried_before = target.num_retried
    with sampler, CpuAccount(proc) as cpu:
        steps = [Step(0.0, args.seconds, args.factor)]
        records = play(url, target, steps, capacity, seed=args.seed, timeout_s=args.timeout_s)
    if spy is not None:
        spy.wait()
    policy_after = policy_state(url, MODEL)
    latencies, health_bad = pipe.recv()
    prober.join()
    time.sleep(10.0)
    after = sampler.now_mb()
    answered = [r for r in records if r.outcome.ok]
    shed = [r for r in records if r.outcome.status == 503]
    good = [r for r in answered if r.latency_s * 1e3 <= args.slo_ms]
    timed_out = sum(1 for r in records if r.outcome.status == STATUS_TIMEOUT)
    return Outcome(
        config=name, compute_nice=run[0], repeat=run[1],
        offered=len(records), answered=len(answered), good=len(good),
        shed=len(shed), timed_out=timed_out,
        other=len(records) - len(answered) - len(shed) - timed_out,
        goodput_share=len(good) / args.seconds / capacity,
        admitted_p99_ms=p99_ms(answered), shed_p99_ms=p99_ms(shed),
        admitted_sent_p99_ms=p99_ms(answered, "sent"), shed_sent_p99_ms=p99_ms(shed, "sent"),
        client_lag_p99_ms=p99_ms(records, "lag"),
        health_p99_ms=summary(latencies)["p99"], health_bad=health_bad,
        rss_before_mb=before, rss_peak_mb=max(sampler.peak_mb, before), rss_after_mb=after,
        server_cores=cpu.cores(cpu.server_s), generator_cores=cpu.cores(cpu.generator_s),
        server_threads_cores={k: round(cpu.cores(v), 3) for k, v in cpu.threads_s.items()
                              if cpu.cores(v) >= 0.005},
        server_us_per_request=cpu.server_s / max(1, len(records)) * 1e6,
        generator_us_per_request=cpu.generator_s / max(1, len(records)) * 1e6,
        policy_counts=policy_counts(policy_before, policy_after), thread_nices=thread_nices(proc),
        thread_switches_per_s=cpu.switches_per_s, retried=target.num_retried - retried_before,
        other_errors=sorted({str(r.outcome.error) for r in records if not r.outcome.ok
                             and r.outcome.status not in (503, STATUS_TIMEOUT)})[:5],
        other_statuses=dict(Counter(r.outcome.status for r in records if not r.outcome.ok
                                    and r.outcome.status not in (503, STATUS_TIMEOUT))),
    )  # fmt: skip


def measure_capacity(url: str, target: V2Target, triton: dict[str, object]) -> tuple[float, float]:
    """(closed-loop, open-loop) capacity in req/s of the server at `url`, its model under
    Triton's rules: an adaptive policy's 503s would count as requests it cannot carry."""
    reload(url, MODEL, triton)
    closed = max(capacity_rps(url, target, 5.0) for _ in range(2))
    print(f"closed-loop capacity (32 clients): {closed:.1f} req/s; open loop:", flush=True)
    capacity = run_async(open_loop_capacity(target, url, MODEL, closed))
    if capacity <= 0:
        raise SystemExit("not even 0.2x the closed-loop rate was sustained: machine too busy")
    return closed, capacity


def config_override(repo: Path, spec: str, slo_ms: float) -> dict[str, object] | None:
    """The reload override of a --configs entry: `shipped`, `adaptive` or `triton` (the file's
    config under Triton's batching rules), optionally followed by `@key=value;...` laid over the
    file's [parameters] (e.g. adaptive@dynamic_block_base=4)."""
    name, _, assignments = spec.partition("@")
    override = {
        "shipped": None,
        "adaptive": adaptive_override(slo_ms, None),
        "triton": under_triton_rules(repo / MODEL / "config.toml"),
    }[name]
    if not assignments:
        return override
    config = tomllib.loads((repo / MODEL / "config.toml").read_text())
    extra = tomllib.loads("\n".join(assignments.split(";")))
    return {**(override or {}), "parameters": {**config.get("parameters", {}), **extra}}


def run(repo: Path, args: argparse.Namespace) -> dict[str, object]:
    """Every config on a server per compute niceness, the nicenesses interleaved per round."""
    closed, capacity = 0.0, args.capacity  # given: builds compared at the same offered rate
    configs = {spec: config_override(repo, spec, args.slo_ms) for spec in args.configs.split(",")}
    outcomes = []
    nices = [int(n) for n in args.compute_nice.split(",")]
    for repeat in range(1, args.repeats + 1):
        for nice in nices:
            log = args.out / f"server.nice{nice}.r{repeat}.log"
            extra = ("--compute-nice", str(nice))
            with serving(repo, args.src.resolve(), log, extra=extra) as (url, port):
                target = V2Target(Endpoint.from_url(url), v2_requests(url, 256, args.words))
                play(url, target, [Step(0.0, 3.0, 1.0)], 20.0, seed=1, timeout_s=10.0)  # warm
                if capacity <= 0:
                    triton = config_override(repo, "triton", args.slo_ms)
                    assert triton is not None
                    closed, capacity = measure_capacity(url, target, triton)
                    print(f"open-loop capacity {capacity:.1f} req/s; overload {args.factor:g}x = "
                          f"{capacity * args.factor:.0f} req/s for {args.seconds:g} s",
                          flush=True)  # fmt: skip
                for name in args.configs.split(","):
                    print(f"{name}, compute_nice {nice}, round {repeat} (load "
                          f"{os.getloadavg()[0]:.2f}) ...", flush=True)  # fmt: skip
                    outcome = overload(url, port, target, name, configs[name], capacity, args,
                                       (nice, repeat))  # fmt: skip
                    outcomes.append(outcome)
                    print("  " + json.dumps(asdict(outcome)), flush=True)
    return {"closed_rps": closed, "capacity_rps": capacity, "outcomes": outcomes,
            "load_average": os.getloadavg()}  # fmt: skip


def report(found: dict[str, object], args: argparse.Namespace) -> None:
    print(f"\n{args.factor:g}x open-loop capacity ({found['capacity_rps']:.1f} req/s) for "
          f"{args.seconds:g} s, SLO {args.slo_ms:g} ms")  # fmt: skip
    print("| config | nice | round | goodput / capacity | admitted P99 ms (from send) | 503s "
          "| 503 P99 ms (from send) | client lag P99 ms | timeouts | other | health P99 ms "
          "| RSS MB before / peak / after |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    cpu_rows = []
    for o in found["outcomes"]:  # type: ignore[attr-defined]
        print(f"| {o.config} | {o.compute_nice} | {o.repeat} | {o.goodput_share:.2f} | "
              f"{o.admitted_p99_ms:.0f} "
              f"({o.admitted_sent_p99_ms:.0f}) | {o.shed} | {o.shed_p99_ms:.1f} "
              f"({o.shed_sent_p99_ms:.1f}) | {o.client_lag_p99_ms:.1f} | {o.timed_out} | "
              f"{o.other} | {o.health_p99_ms:.1f} | {o.rss_before_mb:.0f} / {o.rss_peak_mb:.0f} "
              f"/ {o.rss_after_mb:.0f} |")  # fmt: skip
        cpu_rows.append(f"  {o.config} nice {o.compute_nice} round {o.repeat}: server "
                        f"{o.server_cores:.2f} cores "
                        f"({o.server_us_per_request:.0f} us/request; by thread "
                        f"{o.server_threads_cores}), load generator {o.generator_cores:.2f} "
                        f"cores ({o.generator_us_per_request:.0f} us/request); other: "
                        f"{o.other_statuses} {o.other_errors}; retried: {o.retried}; "
                        f"policy: {o.policy_counts}; nice by thread: {o.thread_nices}; "
                        f"switches/s [vol, preempted]: {o.thread_switches_per_s}")  # fmt: skip
    print("CPU during the overload (of 2 cores):")
    print("\n".join(cpu_rows))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument(
        "--capacity",
        type=float,
        default=0.0,
        help="req/s taken as capacity instead of measuring it (0: measure)",
    )
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--slo-ms", type=float, default=100.0)
    parser.add_argument(
        "--configs",
        default="shipped,adaptive",
        help="shipped / adaptive / triton, each optionally with @key=value;... over [parameters]",
    )
    parser.add_argument(
        "--compute-nice",
        default="0",
        help="comma-separated `fulcrum serve --compute-nice` values, a server each (e.g. 0,2,5)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds over --compute-nice")
    parser.add_argument("--words", type=int, default=8)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--repository", type=Path, default=None)
    parser.add_argument("--src", type=Path, default=Path(__file__).parent.parent / "src")
    parser.add_argument("--out", type=Path, default=Path("/tmp/overload_minute"))
    parser.add_argument(
        "--py-spy", action="store_true", help="record the server with py-spy during the overload"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        found = run(args.repository or build_repository(Path(tmp)), args)
    report(found, args)
    outcomes = [asdict(o) for o in found["outcomes"]]  # type: ignore[attr-defined]
    (args.out / "overload.json").write_text(json.dumps({**found, "outcomes": outcomes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
