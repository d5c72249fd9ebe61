"""The `fulcrum profile` sub-command: `fulcrum profile MODEL --repository DIR [--variant V]`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulcrum.config import ModelConfig
from fulcrum.loadgen.cli import add_model_arguments, int_list
from fulcrum.tuning.locate import locate_model

# Heavy modules (numpy work, backends, rich, matplotlib) load when the command runs.
if TYPE_CHECKING:
    from fulcrum.tuning.profile_report import AnyResult


def _fraction(text: str) -> float:
    """'10%' or '0.1' -> 0.1."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction like 0.1 or 10%; got {text!r}"
        ) from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a fraction in [0, 1) or a percentage; got {text!r}"
        )
    return value


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `profile` to the top-level CLI's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "profile",
        help="fixed-input baseline of a model run directly on its backend (no server)",
        description="fulcrum profile MODEL --repository DIR [--variant V | --all-variants]",
    )
    add_model_arguments(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--variant", help="variant to profile (default: the model's default)")
    which.add_argument("--all-variants", action="store_true", help="profile each and compare")
    p.add_argument("--out", type=Path, help="write profile.json and profile.png here")
    sweep = p.add_argument_group("sweep")
    sweep.add_argument(
        "--batch-sizes", type=int_list, default=(), help="e.g. 1,2,4 (default: doubling)"
    )
    sweep.add_argument("--max-batch", type=int, default=0, help="0: max_batch_size / max_num_seqs")
    sweep.add_argument("--lengths", type=int_list, default=(16, 64, 256), help="tokens or -1 dims")
    sweep.add_argument("--warmup", type=int, default=2, help="unmeasured runs per point")
    sweep.add_argument("--repeats", type=int, default=10, help="measured runs per point")
    sweep.add_argument("--max-seconds", type=float, default=10.0, help="per point")
    sweep.add_argument("--knee-margin", type=_fraction, default=0.10, help="default 10%%")
    sweep.add_argument("--backoff", type=_fraction, default=0.20, help="default 20%%")
    sweep.add_argument("--full-sweep", action="store_true", help="go on past the knee")
    sweep.add_argument("--memory-budget-mb", type=float, help="default: memory available now")
    sweep.add_argument("--seed", type=int, default=0)
    llm = p.add_argument_group("LLM models")
    llm.add_argument("--prompt-tokens", type=int, default=128)
    llm.add_argument("--output-tokens", type=int, default=64)
    p.set_defaults(func=main)
    return p


def _profile(config: ModelConfig, version_dir: Path, args: argparse.Namespace) -> AnyResult:
    if config.platform == "llm":
        from fulcrum.tuning.profile_llm import LlmProfileOptions, measure_llm

        llm_options = LlmProfileOptions(
            batch_sizes=args.batch_sizes,
            max_batch=args.max_batch,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            warmup=args.warmup,
            repeats=args.repeats,
            max_seconds_per_point=args.max_seconds,
            knee_margin=args.knee_margin,
            backoff=args.backoff,
            stop_at_knee=not args.full_sweep,
            seed=args.seed,
        )
        return measure_llm(config, version_dir, llm_options)
    from fulcrum.tuning.profile import ProfileOptions, measure

    options = ProfileOptions(
        batch_sizes=args.batch_sizes,
        max_batch=args.max_batch,
        lengths=args.lengths,
        warmup=args.warmup,
        repeats=args.repeats,
        max_seconds_per_point=args.max_seconds,
        knee_margin=args.knee_margin,
        backoff=args.backoff,
        stop_at_knee=not args.full_sweep,
        memory_budget_mb=args.memory_budget_mb,
        seed=args.seed,
    )
    return measure(config, version_dir, options)


def main(args: argparse.Namespace) -> int:
    """Entry point of `fulcrum profile`; errors (FulcrumError) are the caller's to print."""
    from rich.console import Console

    from fulcrum.tuning.profile_report import (
        PNG_FILE,
        comparison_table,
        plot_profile,
        print_result,
        write_json,
    )
    from fulcrum.variants import default_variant, resolve_variant, variant_names

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped into a file: no 80-column squeeze
    config, version_dir = locate_model(args.repository, args.model, args.version)
    names = (
        variant_names(config) if args.all_variants else [args.variant or default_variant(config)]
    )
    resolved = [(name, resolve_variant(config, name)) for name in names]  # unknown: fail first
    results: list[AnyResult] = []
    for name, variant_config in resolved:
        result = _profile(variant_config, version_dir, args)
        result.variant = name
        print_result(result, console)
        results.append(result)
    if len(results) > 1:
        console.print(comparison_table(results))
        console.print(
            "note: the variants ran one after another in this process, so a later variant's "
            "memory figures may include memory an earlier one left allocated; profile one "
            "--variant per run for clean memory figures",
            markup=False,
            highlight=False,
        )
    if args.out is not None:
        json_path = write_json(results, args.out)
        png_path = plot_profile(results, args.out / PNG_FILE)
        console.print(f"wrote {json_path} and {png_path}", markup=False, highlight=False)
    return 0
