"""The `fulcrum bench` sub-command: `fulcrum bench MODEL --url ...` and `fulcrum bench compare`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulcrum.errors import FulcrumError, InvalidInput

# Heavy modules load when the command runs, not when `fulcrum` builds its parser.
if TYPE_CHECKING:
    from rich.console import Console

    from fulcrum.loadgen.bench import BenchOptions

EXIT_ERROR = 1
EXIT_UNREACHABLE = 2


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated integers (`1,2,4`)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4; got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 50,100; got {text!r}") from None


def _add_load_args(p: argparse.ArgumentParser) -> None:
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=int_list, default=(), help="closed loop: e.g. 1,2,4,8")
    load.add_argument("--rate", type=_floats, default=(), help="open loop requests/s: 50,100")
    load.add_argument("--arrivals", default="poisson", choices=("poisson", "constant", "gamma"))
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; <1 is bursty")
    load.add_argument("--duration", type=float, default=10.0, help="max measured s per point")
    load.add_argument("--window", type=float, default=2.0, help="measurement window s")
    load.add_argument("--warmup", type=float, default=1.0, help="warm-up s per point")
    load.add_argument("--stability", type=float, default=10.0, help="stability percent")
    load.add_argument("--max-requests", type=int, default=0, help="per point; 0: no bound")
    load.add_argument("--timeout", type=float, default=30.0, help="per request s")
    load.add_argument("--max-in-flight", type=int, default=1024, help="open loop slot cap")
    load.add_argument("--seed", type=int, default=0)


def _add_slo_args(p: argparse.ArgumentParser) -> None:
    slo = p.add_argument_group("objectives")
    slo.add_argument("--slo", action="append", default=[], help="p99=100ms, latency<=100ms, ...")
    slo.add_argument("--max-rate-under", help="search the highest rate holding e.g. p99=100ms")
    slo.add_argument("--search-start", type=float, default=16.0, help="first rate searched")


def _add_input_args(p: argparse.ArgumentParser) -> None:
    inputs = p.add_argument_group("inputs")
    inputs.add_argument("--batch-size", type=int, default=1, help="rows per request")
    inputs.add_argument("--length", default="16", help="words/tokens: N, A-B or MEAN:STD")
    inputs.add_argument("--input-file", type=Path, help="JSONL of real requests")
    inputs.add_argument("--binary", action="store_true", help="binary tensor extension")
    inputs.add_argument(
        "--stream-rows",
        action="store_true",
        help="v2 rows streamed back (/infer_stream): reports time to first rows",
    )
    inputs.add_argument("--openai", action="store_true", help="OpenAI streaming completions")
    inputs.add_argument("--chat", action="store_true", help="with --openai: chat completions")
    inputs.add_argument("--max-tokens", type=int, default=64, help="with --openai")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench` to the top-level CLI's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="measure latency and throughput of a served model",
        description="fulcrum bench MODEL --url URL [...]  |  fulcrum bench compare RUN_DIR...",
    )
    p.add_argument("model", metavar="MODEL", help="model name, or 'compare'")
    p.add_argument("runs", nargs="*", type=Path, metavar="RUN_DIR", help="with compare")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--out", type=Path, help="write results.json, results.csv and plots here")
    p.add_argument("--label", default="", help="name of this run in tables and plots")
    p.add_argument("--no-progress", action="store_true")
    _add_load_args(p)
    _add_slo_args(p)
    _add_input_args(p)
    p.set_defaults(func=main)
    return p


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """The parsed command line as `BenchOptions`."""
    from fulcrum.loadgen.bench import BenchOptions
    from fulcrum.loadgen.inputs import LengthDist
    from fulcrum.loadgen.kserve import V2Inputs
    from fulcrum.loadgen.llm import LlmInputs
    from fulcrum.loadgen.windows import MeasurePlan

    lengths = LengthDist.parse(args.length)
    return BenchOptions(
        model=args.model,
        url=args.url,
        concurrency=args.concurrency,
        rates=args.rate,
        arrivals=args.arrivals,
        burstiness=args.burstiness,
        plan=MeasurePlan(
            warmup_s=args.warmup,
            window_s=min(args.window, args.duration),
            max_duration_s=args.duration,
            max_requests=args.max_requests,
            stability_pct=args.stability,
        ),
        slos=tuple(args.slo),
        max_rate_under=args.max_rate_under,
        search_start_rate=args.search_start,
        openai=args.openai,
        v2=V2Inputs(
            batch_size=args.batch_size,
            lengths=lengths,
            input_file=args.input_file,
            binary=args.binary,
            stream_rows=args.stream_rows,
            seed=args.seed,
        ),
        llm=LlmInputs(
            chat=args.chat,
            prompt_lengths=lengths,
            max_tokens=args.max_tokens,
            input_file=args.input_file,
            seed=args.seed,
        ),
        timeout_s=args.timeout,
        max_in_flight=args.max_in_flight,
        seed=args.seed,
        label=args.label,
        out=args.out,
    )


def _bench(args: argparse.Namespace, console: Console) -> int:
    from fulcrum.loadgen.bench import run_bench
    from fulcrum.loadgen.report import print_run

    if args.runs:
        raise InvalidInput(
            f"unexpected arguments {[str(r) for r in args.runs]}; did you mean compare?"
        )
    options = options_from_args(args)
    run = run_bench(options, progress=not args.no_progress)
    print_run(run, console)
    if options.out is not None:
        console.print(f"wrote results.json, results.csv and plots to {options.out}")
    return 0


def main(args: argparse.Namespace) -> int:
    """Entry point of `fulcrum bench`; an exit code."""
    from rich.console import Console

    from fulcrum.client import ClientError

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped into a file: no 80-column squeeze
    try:
        if args.model == "compare":
            from fulcrum.loadgen.compare import compare

            compare(args.runs, out_dir=args.out, console=console)
            return 0
        return _bench(args, console)
    except ClientError as exc:
        print(f"fulcrum bench: {exc.message}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except FulcrumError as exc:
        print(f"fulcrum bench: {exc.message}", file=sys.stderr)
        return EXIT_ERROR


def name_list(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated names (`fp16,int8`), blanks dropped."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL, --repository and --version: how the tools that read a repository name a model."""
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--repository", type=Path, required=True, help="the model repository")
    p.add_argument("--version", type=int, help="version folder (default: the highest)")
