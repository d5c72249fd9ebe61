"""The best static config by `fulcrum tune`: adaptive_vs_static.py's policy (c), as the issue asks.

`fulcrum tune` reads the model's config.toml and measures candidates as overrides of it, so the
trace's server serves a copy of the repository's minilm whose [dynamic_batching] is under Triton's
rules (minilm ships the adaptive policy). The search is the batching knobs only (max_batch_size,
max_queue_delay_ms, preferred_batch_sizes): variant, instances and threads stay the file's, as
they do for the adaptive policy, so the trace compares batching policies and nothing else. Tune's
goodput is the highest Poisson rate whose P99 holds the SLO with no errors (a 503 is one), found
by bisection; its winner is re-measured against the file's config in alternation (`--confirm`).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from fulcrum.config import load_model_config
from fulcrum.loadgen.inputs import LengthDist
from fulcrum.loadgen.kserve import V2Inputs
from fulcrum.tuning.config_file import edit_config, set_values
from fulcrum.tuning.search_space import override_for
from fulcrum.tuning.tune import TuneOptions
from fulcrum.tuning.tune_cli import run_tune

DIMENSIONS = ("max_batch_size", "max_queue_delay_ms", "preferred_batch_sizes")


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("static by fulcrum tune").add_argument
    add("--no-tune", action="store_true", help="skip fulcrum tune's static config (sweep only)")
    add("--tune-trials", type=int, default=12, help="fulcrum tune --budget-trials")
    add("--tune-point-s", type=float, default=3.0, help="fulcrum tune --point-seconds")


def triton_copy(repo: Path, tmp: Path, model: str) -> Path:
    """A repository holding a copy of `model` whose [dynamic_batching] is under Triton's rules."""
    out = tmp / "triton-rules"
    shutil.copytree(repo / model, out / model)
    edit_config(out / model / "config.toml", set_values({"dynamic_batching.policy": "triton"}))
    return out


def tuned_static(
    url: str, repo: Path, model: str, args: argparse.Namespace, capacity: float
) -> tuple[str, dict[str, object]] | None:
    """(label, reload override) of tune's winner; None when it kept the file's config or found
    nothing that holds the SLO (said on stdout)."""
    options = TuneOptions(
        model=model, repository=repo, url=url, slos=(f"p99={args.slo_ms:g}ms",),
        only=DIMENSIONS, budget_trials=args.tune_trials, point_s=args.tune_point_s,
        search_start_rps=max(16.0, 0.5 * capacity), seed=args.seed,
        v2=V2Inputs(lengths=LengthDist(args.words, args.words), num_distinct=64),
    )  # fmt: skip
    print(f"fulcrum tune {model} --slo p99={args.slo_ms:g}ms --only {','.join(DIMENSIONS)} "
          f"--budget-trials {args.tune_trials} --point-seconds {args.tune_point_s:g} ...",
          flush=True)  # fmt: skip
    result = run_tune(options)
    for note in result.notes:
        print(f"  tune: {note}", flush=True)
    for confirmed in result.confirmation:
        runs = ", ".join(f"{g:.0f}" for g in confirmed.goodputs)
        print(f"  tune: trial {confirmed.trial} re-measured: {runs} req/s", flush=True)
    winner = result.trial(result.winner)
    if winner is None:
        print("  tune: no config held the SLO; its static config is left out", flush=True)
        return None
    goodput = winner.figures.goodput_rps if winner.figures is not None else 0.0
    print(f"  tune's winner: trial {winner.index}, {winner.candidate.label()}, "
          f"{goodput:.1f} req/s within the SLO", flush=True)  # fmt: skip
    if not winner.changes:
        print("  tune kept the file's config: the shipped static one", flush=True)
        return None
    config = load_model_config(repo / model / "config.toml", dir_name=model)
    return f"tuned static ({winner.candidate.label()})", override_for(config, winner.changes)
