"""`fulcrum bench compare RUN_DIR...`: several runs in one table and on one set of plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from fulcrum.errors import InvalidInput
from fulcrum.loadgen.plots import write_plots
from fulcrum.loadgen.report import compare_table, load_run
from fulcrum.loadgen.results import BenchRun


def label_runs(runs: Sequence[BenchRun], paths: Sequence[Path]) -> list[BenchRun]:
    """Runs with distinct labels: a repeated label gets its folder name appended."""
    labels = [r.label for r in runs]
    for run, path in zip(runs, paths, strict=True):
        if labels.count(run.label) > 1:
            run.label = f"{run.label} ({path.name})"
    return list(runs)


def compare(
    paths: Sequence[Path], *, out_dir: Path | None = None, console: Console | None = None
) -> list[BenchRun]:
    """Print the runs side by side; with `out_dir`, write the overlaid plots there."""
    if not paths:
        raise InvalidInput("compare needs at least one run folder")
    runs = label_runs([load_run(p) for p in paths], paths)
    (console or Console()).print(compare_table(runs))
    if out_dir is not None:
        write_plots(runs, out_dir)
    return runs
