"""The `fulcrum tune` sub-command: `fulcrum tune MODEL --repository DIR --slo p99=100ms`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulcrum.errors import FulcrumError, InvalidInput
from fulcrum.loadgen.cli import name_list

# Heavy modules load when the command runs, not when `fulcrum` builds its parser.
if TYPE_CHECKING:
    from fulcrum.tuning.tune import TuneOptions, TuneResult

EXIT_ERROR = 1
EXIT_UNREACHABLE = 2
EXIT_NO_WINNER = 3  # the run worked, but no config met the constraints
_SHORT_LLM_SLO = ("ttft=", "tpot=")


def slo_list(values: list[str]) -> tuple[str, ...]:
    """`--slo` values, each possibly comma-separated; `ttft=200ms` is short for `ttft:p99=200ms`."""
    from fulcrum.loadgen.stats import parse_slo

    texts: list[str] = []
    for value in values:
        for part in (p.strip() for p in value.split(",")):
            if not part:
                continue
            if part.startswith(_SHORT_LLM_SLO):
                metric, _, bound = part.partition("=")
                part = f"{metric}:p99={bound}"
            parse_slo(part)  # a bad one fails here, before any reload
            texts.append(part)
    return tuple(texts)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `tune` to the top-level CLI's subparsers."""
    from fulcrum.tuning.ranking import OBJECTIVES
    from fulcrum.tuning.search_space import DIMENSIONS, SCENARIOS

    p: argparse.ArgumentParser = subparsers.add_parser(
        "tune",
        help="search batching, instances, threads and variants for the best config under an SLO",
        description="fulcrum tune MODEL --url URL --repository DIR --slo p99=100ms [...]",
    )
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--repository", type=Path, required=True, help="the server's model repository")
    p.add_argument("--slo", action="append", default=[], required=True,
                   help="p99=100ms, latency<=100ms; LLM: ttft=200ms,tpot=50ms")  # fmt: skip
    p.add_argument("--rate", type=float, help="meet the SLO at this rate (default: search the max)")
    p.add_argument("--max-fidelity-loss", type=float, default=0.01, help="of a variant; 0.01: 1%%")
    p.add_argument("--objective", choices=OBJECTIVES, default="goodput")
    p.add_argument("--cost-per-hour", type=float, help="the machine's price, for cost and score")
    p.add_argument("--alpha", type=float, default=1.0, help="score: weight of throughput/cost")
    p.add_argument("--beta", type=float, default=1.0, help="score: weight of 1/latency")
    p.add_argument("--tie", type=float, default=2.0, help="percent of goodput counted as noise")
    p.add_argument("--scenario", choices=SCENARIOS, help="start from a preset")
    p.add_argument("--budget-trials", type=int, default=16, help="configs measured at most")
    p.add_argument("--confirm", type=int, default=2, metavar="ROUNDS",
                   help="re-measure the current config and the winner ROUNDS times each, "
                   "alternating; the winner must still beat it (0: trust the search)")  # fmt: skip
    p.add_argument("--only", type=name_list, default=(), help=f"sweep only: {','.join(DIMENSIONS)}")
    p.add_argument("--cores", type=int, default=0, help="the server's cores (default: this one's)")
    p.add_argument("--apply", action="store_true", help="write the winner into config.toml")
    p.add_argument("--out", type=Path, help="write tune.json, pareto.png, config.diff here")
    p.add_argument("--admin-token", default="", help="the server's --admin-token")
    load = p.add_argument_group("measurement")
    load.add_argument("--point-seconds", type=float, default=3.0, help="measured s per point")
    load.add_argument("--warmup", type=float, default=0.5, help="warm-up s per point")
    load.add_argument("--search-start", type=float, default=16.0, help="first rate tried")
    load.add_argument("--search-steps", type=int, default=6, help="points per rate search")
    load.add_argument("--timeout", type=float, default=10.0, help="per request s")
    load.add_argument("--batch-size", type=int, default=1, help="rows per request")
    load.add_argument("--length", default="16", help="words/tokens: N, A-B or MEAN:STD")
    load.add_argument("--input-file", type=Path, help="JSONL of real requests")
    load.add_argument("--max-tokens", type=int, default=64, help="LLM: tokens per completion")
    load.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)
    return p


def options_from_args(args: argparse.Namespace) -> TuneOptions:
    """The parsed command line as `TuneOptions`."""
    from fulcrum.loadgen.inputs import LengthDist
    from fulcrum.loadgen.kserve import V2Inputs
    from fulcrum.loadgen.llm import LlmInputs
    from fulcrum.tuning.ranking import ObjectiveSpec
    from fulcrum.tuning.tune import TuneOptions

    if args.batch_size < 1 or args.budget_trials < 1 or args.search_steps < 1:
        raise InvalidInput("--batch-size, --budget-trials and --search-steps must be >= 1")
    if not 0 <= args.max_fidelity_loss < 1:
        raise InvalidInput(f"--max-fidelity-loss {args.max_fidelity_loss}: must lie in [0, 1)")
    lengths = LengthDist.parse(args.length)
    spec = ObjectiveSpec(
        objective=args.objective, cost_per_hour=args.cost_per_hour, alpha=args.alpha,
        beta=args.beta, tie_pct=args.tie,
    )  # fmt: skip
    return TuneOptions(
        model=args.model, repository=args.repository, url=args.url, slos=slo_list(args.slo),
        rate_rps=args.rate, max_fidelity_loss=args.max_fidelity_loss, spec=spec,
        scenario=args.scenario, budget_trials=args.budget_trials,
        confirm_rounds=max(0, args.confirm), num_cores=args.cores,
        only=args.only, point_s=args.point_seconds, warmup_s=args.warmup,
        search_start_rps=args.search_start, search_steps=args.search_steps,
        v2=V2Inputs(batch_size=args.batch_size, lengths=lengths, input_file=args.input_file,
                    seed=args.seed),
        llm=LlmInputs(prompt_lengths=lengths, max_tokens=args.max_tokens,
                      input_file=args.input_file, seed=args.seed),
        timeout_s=args.timeout, admin_token=args.admin_token, apply=args.apply, seed=args.seed,
    )  # fmt: skip


def run_tune(options: TuneOptions, *, echo: bool = True) -> TuneResult:
    """Run a tune on a fresh uvloop event loop, printing a line per trial when `echo`."""
    import uvloop
    from rich.console import Console

    from fulcrum.tuning.ranking import Trial
    from fulcrum.tuning.tune import run_tune_async

    console = Console(stderr=True)

    def on_trial(trial: Trial) -> None:
        fig = trial.figures
        figures = "not measured" if fig is None else (
            f"{fig.goodput_rps:.1f} rps good at {'>=' if fig.rate_is_lower_bound else ''}"
            f"{fig.rate_rps:g} rps, {fig.latency_ms:.1f} ms"
        )  # fmt: skip
        verdict = "meets" if trial.feasible else "; ".join(trial.reasons)
        line = (
            f"trial {trial.index} [{trial.phase}] {trial.candidate.label()}: {figures}: {verdict}"
        )
        console.print(line, markup=False, highlight=False)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run_tune_async(options, on_trial=on_trial if echo else None))


def main(args: argparse.Namespace) -> int:
    """Entry point of `fulcrum tune`; an exit code."""
    from rich.console import Console

    from fulcrum.client import ClientError
    from fulcrum.tuning.tune_report import print_result, write_result

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped into a file: no 80-column squeeze
    try:
        result = run_tune(options_from_args(args))
        print_result(result, console)
        if args.out is not None:
            write_result(result, args.out)
            console.print(f"wrote tune.json and pareto.png to {args.out}")
    except ClientError as exc:
        print(f"fulcrum tune: {exc.message}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except FulcrumError as exc:
        print(f"fulcrum tune: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    return 0 if result.winner is not None else EXIT_NO_WINNER
