"""What `fulcrum tune` shows: the trial table, why the winner won, the diff, tune.json and the
Pareto plot of latency against goodput."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table

from fulcrum.extras import require
from fulcrum.loadgen.stats import parse_slo
from fulcrum.tuning.ranking import Trial, TrialFigures, merits, objective_value, rank
from fulcrum.tuning.tune import TuneResult

TUNE_JSON = "tune.json"
PARETO_PNG = "pareto.png"
CONFIG_DIFF = "config.diff"
_UNITS = {"goodput": "rps", "cost": "$/M req", "score": ""}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _metric(result: TuneResult) -> str:
    """The column title of the first SLO's metric ("p99 ms", "ttft p99 ms")."""
    first = result.slos[0] if result.slos else "latency"
    return f"{first.split('=')[0].split('<')[0]} ms"


def trial_table(result: TuneResult) -> Table:
    """Every trial: what it changed, what it measured, and its verdict."""
    spec = result.spec
    scored = merits(result.trials, spec)
    unit = _UNITS[spec.objective]
    table = Table(title=f"fulcrum tune {result.model}: {', '.join(result.slos)}")
    headers = ("#", "phase", "config", "rate", "goodput", _metric(result), "batch",
               f"{spec.objective} {unit}".strip(), "verdict")  # fmt: skip
    for header in headers:
        table.add_column(
            header, justify="left" if header in ("phase", "config", "verdict") else "right"
        )
    for trial in result.trials:
        fig = trial.figures
        mark = "*" if trial.index in result.pareto else ""
        table.add_row(
            f"{trial.index}{mark}",
            trial.phase,
            escape(trial.candidate.label()),
            _rate(fig),
            _fmt(fig.goodput_rps if fig else None),
            _fmt(fig.latency_ms if fig else None),
            _fmt(fig.mean_batch_size if fig else None),
            _fmt(objective_value(trial, spec, scored), 3 if spec.objective != "goodput" else 1),
            escape(_verdict(trial, result.winner)),
            style="bold green" if trial.index == result.winner else None,
        )
    table.caption = (
        "* on the Pareto frontier (goodput vs latency); rate: the operating point "
        "(>=: no higher rate failed within the search steps)"
    )
    return table


def _rate(figures: TrialFigures | None) -> str:
    if figures is None:
        return "-"
    return (">=" if figures.rate_is_lower_bound else "") + f"{figures.rate_rps:.1f}"


def _verdict(trial: Trial, winner: int | None) -> str:
    if trial.index == winner:
        return "WINNER"
    if trial.feasible:
        return "meets"
    return "; ".join(trial.reasons)


def _kind(reason: str) -> str:
    if reason.startswith("reload refused"):
        return "refused by the server"
    if reason.startswith("variant "):
        return "fidelity"
    return "SLO"


def why_text(result: TuneResult) -> str:
    """A paragraph: which constraints knocked trials out, the objective values, the margins."""
    spec = result.spec
    scored = merits(result.trials, spec)
    current = result.trials[0] if result.trials else None
    winner = result.trial(result.winner)
    lines = [_knockouts(result)]
    if winner is None:
        lines.append(
            "No trial met every constraint: loosen the SLO, lower --rate, or allow more "
            "fidelity loss; the current config stays."
        )
        return " ".join(line for line in lines if line)
    value = _fmt(objective_value(winner, spec, scored), 3)
    lines.append(
        f"Trial {winner.index} ({winner.candidate.label()}) wins on {spec.objective} "
        f"= {value} {_UNITS[spec.objective]}".rstrip()
        + "."
    )
    if current is not None and winner.index != current.index:
        lines.append(_against_current(result, winner, current))
    elif current is not None:
        lines.append("The current config is already the best found: nothing to change.")
    ranked = rank(result.trials, spec)
    if len(ranked) > 1:
        second = ranked[1]
        lines.append(
            f"Runner-up: trial {second.index} ({second.candidate.label()}) at "
            f"{_fmt(objective_value(second, spec, scored), 3)}{_tie_note(result, winner, second)}."
        )
    bounded = [
        t.index for t in (current, winner) if t and t.figures and t.figures.rate_is_lower_bound
    ]
    if bounded:
        lines.append(
            f"Trial {' and '.join(map(str, sorted(set(bounded))))}: no rate tried failed, so the "
            "rate is a lower bound; raise --search-start or --search-steps for a fair comparison."
        )
    if result.skipped_variants:
        left = "; ".join(f"{k}: {v}" for k, v in result.skipped_variants.items())
        lines.append(f"Variants not tried: {left}.")
    lines.extend(_confirmation_text(result))
    return " ".join(line for line in lines if line)


def _confirmation_text(result: TuneResult) -> list[str]:
    if not result.confirmation:
        return []
    parts = [
        f"trial {c.trial} {_fmt(c.median, 1)} (" + ", ".join(_fmt(g, 1) for g in c.goodputs) + ")"
        for c in result.confirmation
    ]
    return [f"Goodput re-measured in alternation, median (each run): {'; '.join(parts)}."]


def _knockouts(result: TuneResult) -> str:
    failed = [t for t in result.trials if not t.feasible]
    if not failed:
        return f"All {len(result.trials)} trials met the constraints."
    kinds: dict[str, int] = {}
    for trial in failed:
        kind = _kind(trial.reasons[0]) if trial.reasons else "not measured"
        kinds[kind] = kinds.get(kind, 0) + 1
    counted = ", ".join(f"{kind} {n}" for kind, n in kinds.items())
    example = failed[0]
    return (
        f"{len(failed)} of {len(result.trials)} trials broke a constraint ({counted}); e.g. "
        f"trial {example.index} ({example.candidate.label()}): {'; '.join(example.reasons)}."
    )


def _against_current(result: TuneResult, winner: Trial, current: Trial) -> str:
    assert winner.figures is not None
    won = winner.figures
    if not current.feasible or current.figures is None:
        why = "; ".join(current.reasons) or "not measured"
        return (
            f"The current config (trial 0, same run) broke the constraints ({why}); the winner "
            f"holds them with goodput {won.goodput_rps:.1f} rps at {won.latency_ms:.1f} ms."
        )
    now = current.figures
    gain = (won.goodput_rps / now.goodput_rps - 1) * 100 if now.goodput_rps > 0 else 0.0
    return (
        f"Against the current config (trial 0, same run): goodput {now.goodput_rps:.1f} -> "
        f"{won.goodput_rps:.1f} rps ({gain:+.0f}%), {_metric(result)} {now.latency_ms:.1f} -> "
        f"{won.latency_ms:.1f}."
    )


def _tie_note(result: TuneResult, winner: Trial, second: Trial) -> str:
    spec = result.spec
    if spec.objective == "score" or winner.figures is None or second.figures is None:
        return ""
    scored = merits(result.trials, spec)
    tie = spec.tie_pct / 100
    if scored[second.index] < scored[winner.index] * (1 - tie):
        return ""
    mine, theirs = winner.figures.latency_ms, second.figures.latency_ms
    if theirs > mine * (1 + tie):
        why = f"lost on {_metric(result)} {theirs:.1f} vs {mine:.1f}"
    else:
        why = "as fast too; lost on cores used, then trial order"
    return f", a tie within the {spec.tie_pct:g}% noise margin ({why})"


def print_result(result: TuneResult, console: Console) -> None:
    """The table, the notes, why the winner won, and the config diff."""
    console.print(trial_table(result))
    for note in result.notes:
        console.print(f"note: {note}", style="dim", markup=False)
    console.print(why_text(result), markup=False)
    if result.diff:
        verb = "applied to" if result.applied else "suggested for (use --apply to write)"
        console.print(f"config change {verb} {result.model}/config.toml:")
        console.print(Syntax(result.diff, "diff", theme="ansi_dark", background_color="default"))


def write_result(result: TuneResult, out_dir: Path) -> list[Path]:
    """tune.json, pareto.png and (when the winner changes the file) config.diff."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / TUNE_JSON
    path.write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")
    written = [path, plot_pareto(result, out_dir / PARETO_PNG)]
    if result.diff:
        diff_path = out_dir / CONFIG_DIFF
        diff_path.write_text(result.diff)
        written.append(diff_path)
    return written


def plot_pareto(result: TuneResult, path: Path) -> Path:
    """Latency (the SLO's metric) against goodput: every trial, the frontier, the winner."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    measured = [t for t in result.trials if t.figures is not None]
    _scatter(ax, [t for t in measured if t.feasible], "o", "C0", "meets the constraints")
    _scatter(ax, [t for t in measured if not t.feasible], "x", "0.5", "broke a constraint")
    front = [result.trials[i] for i in result.pareto]
    if front:
        ax.plot(*_xy(front), "-", color="C0", alpha=0.6, label="Pareto frontier")
    for trial in measured:
        assert trial.figures is not None
        ax.annotate(str(trial.index), (trial.figures.goodput_rps, trial.figures.latency_ms),
                    textcoords="offset points", xytext=(4, 4), fontsize="x-small")  # fmt: skip
    winner = result.trial(result.winner)
    if winner is not None:
        _scatter(ax, [winner], "*", "C3", f"winner (trial {winner.index})", size=220)
    _scatter(ax, result.trials[:1] if measured[:1] else [], "s", "C2", "current (trial 0)",
             size=80, hollow=True)  # fmt: skip
    if result.slos:
        bound = parse_slo(result.slos[0])
        ax.axhline(bound.bound_ms, linestyle="--", color="C3", alpha=0.5, label=f"SLO {bound}")
    ax.set_xlabel("goodput under the SLO (requests/s)")
    ax.set_ylabel(_metric(result))
    ax.set_title(f"fulcrum tune {result.model}: {', '.join(result.slos)}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _xy(trials: list[Trial]) -> tuple[list[float], list[float]]:
    figures = [t.figures for t in trials if t.figures is not None]
    return [f.goodput_rps for f in figures], [f.latency_ms for f in figures]


def _scatter(
    ax: Any, trials: list[Trial], marker: str, color: str, label: str, *,
    size: float = 40, hollow: bool = False,
) -> None:  # fmt: skip
    xs, ys = _xy(trials)
    if not xs:
        return
    if marker in ("x", "+"):  # line markers have no face; an edge colour would warn
        ax.scatter(xs, ys, marker=marker, s=size, color=color, label=label)
        return
    face = "none" if hollow else color
    ax.scatter(xs, ys, marker=marker, s=size, facecolors=face, edgecolors=color, label=label)


def _pyplot() -> Any:
    matplotlib = require("tune", "matplotlib", feature="the Pareto plot of `fulcrum tune`")
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt
