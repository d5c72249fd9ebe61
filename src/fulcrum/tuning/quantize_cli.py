"""The `fulcrum quantize` sub-command: write precision variants of a model, measure them against
the reference and print the trade-off table (`--out DIR` also writes quantize.json)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulcrum.errors import FulcrumError
from fulcrum.loadgen.cli import add_model_arguments, int_list, name_list

if TYPE_CHECKING:
    from rich.console import Console

    from fulcrum.tuning.quantize import QuantizeOptions, QuantizeReport, Row

EXIT_ERROR = 2
MB = 1_000_000


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `quantize` to the top-level CLI's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "quantize",
        help="write FP16/INT8/INT4 variants of a model and measure their trade-offs",
        description="fulcrum quantize MODEL --repository DIR [--precisions fp16,int8,...]",
    )
    add_model_arguments(p)
    p.add_argument("--variant-from", help="reference variant (default: the default variant)")
    p.add_argument(
        "--precisions",
        type=name_list,
        default=None,
        help="fp16,int8,int8-static,int4 (default: all)",
    )
    p.add_argument("--validation", type=Path, help="JSONL rows of inputs (+ optional label)")
    p.add_argument("--rows", type=int, default=64, help="generated rows without --validation")
    p.add_argument("--min-fidelity", type=float, default=0.99, help="bound on the metric")
    p.add_argument("--metric", default="auto", choices=("auto", "cosine", "top1", "accuracy"))
    p.add_argument("--no-measure", action="store_true", help="fidelity and size only")
    p.add_argument("--out", type=Path, help="write quantize.json here")
    measure = p.add_argument_group("measuring (as fulcrum profile)")
    measure.add_argument("--batch-sizes", type=int_list, default=(), help="default: 1,2,4,... max")
    measure.add_argument("--max-batch", type=int, default=0, help="0: max_batch_size")
    measure.add_argument("--repeats", type=int, default=10, help="measured runs per point")
    measure.add_argument("--seconds-per-point", type=float, default=10.0)
    measure.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)
    return p


def options_from_args(args: argparse.Namespace) -> QuantizeOptions:
    """The parsed command line as `QuantizeOptions`."""
    from fulcrum.tuning.profile import ProfileOptions
    from fulcrum.tuning.quantize import PRECISIONS, QuantizeOptions

    return QuantizeOptions(
        precisions=args.precisions or PRECISIONS,
        variant_from=args.variant_from,
        validation=args.validation,
        num_rows=args.rows,
        min_fidelity=args.min_fidelity,
        metric=args.metric,
        measure=not args.no_measure,
        profile=ProfileOptions(
            batch_sizes=args.batch_sizes,
            max_batch=args.max_batch,
            repeats=args.repeats,
            max_seconds_per_point=args.seconds_per_point,
            seed=args.seed,
        ),
        version=args.version,
        seed=args.seed,
    )


def main(args: argparse.Namespace) -> int:
    """Entry point of `fulcrum quantize`; an exit code."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    try:
        from fulcrum.tuning.quantize import quantize_model

        report = quantize_model(args.repository, args.model, options_from_args(args))
    except FulcrumError as exc:
        print(f"fulcrum quantize: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    print_report(report, console)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quantize.json").write_text(report.to_json())
        console.print(f"wrote {args.out / 'quantize.json'}")
    return 0


def print_report(report: QuantizeReport, console: Console) -> None:
    """The article's table: precision, size, fidelity, gains, verdict; then notes and the diff."""
    from rich.table import Table

    table = Table(
        title=f"{report.model} v{report.version}: variants against {report.reference!r} "
        f"({report.num_rows} rows, {report.validation})",
        caption=f"{report.machine}; measured {report.measured_at}",
    )
    for header in ("variant", "size", "fidelity", "latency b1", "latency gain"):
        table.add_column(header, justify="right" if header != "variant" else "left")
    for header in ("throughput (knee)", "throughput gain", "verdict"):
        table.add_column(header, justify="left" if header == "verdict" else "right")
    base = report.rows[0].size_bytes
    for row in report.rows:
        table.add_row(
            row.name,
            _size(row.size_bytes, base),
            _fidelity(row),
            "-" if row.latency_ms is None else f"{row.latency_ms:.2f} ms",
            _gain(row.latency_gain),
            _throughput(row),
            _gain(row.throughput_gain),
            row.verdict,
        )
    console.print(table)
    for row in report.rows:
        for note in row.notes:
            console.print(f"  {row.name}: {note}")
    if report.config_diff:
        console.print(f"config updated:\n{report.config_diff}", markup=False, highlight=False)


def _size(size_bytes: int | None, base: int | None) -> str:
    if not size_bytes:
        return "-"
    ratio = f" (x{size_bytes / base:.2f})" if base else ""
    return f"{size_bytes / MB:.1f} MB{ratio}"


def _fidelity(row: Row) -> str:
    if row.fidelity is None:
        return "-" if row.verdict != "reference" else "1 (reference)"
    return f"{row.fidelity_metric} {row.fidelity:.4f}"


def _gain(gain: float | None) -> str:
    if gain is None:
        return "-"
    word = "faster" if gain >= 1 else "slower"
    return f"x{gain:.2f} {word}"


def _throughput(row: Row) -> str:
    if row.throughput_rps is None:
        return "-"
    return f"{row.throughput_rps:.0f}/s @ {row.knee_batch}"
