"""`fulcrum cache calibrate [MODEL] --repository R [--pairs FILE] [--url URL] [--write]`: embeds
labelled pairs with the model (loaded directly, or served at --url), prints hit and false-hit
rates per threshold with and without the verifier, and can write the recommended threshold."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fulcrum.cache import calibration as cal
from fulcrum.errors import ConfigError
from fulcrum.types import Array

_CHUNK = 64  # texts per embedding call
_SHOWN = (0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
EmbedFn = Callable[[list[str]], Array]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `cache` (with `calibrate`) to the top-level CLI's subparsers."""
    cache: argparse.ArgumentParser = subparsers.add_parser("cache", help="result-cache tools")
    tools = cache.add_subparsers(dest="cache_command", required=True)
    p = tools.add_parser(
        "calibrate",
        help="hit and false-hit rates of the semantic tier per threshold, on labelled pairs",
        description=__doc__,
    )
    p.add_argument("model", metavar="MODEL", nargs="?", default="minilm",
                   help="the embedding model (default minilm)")  # fmt: skip
    p.add_argument("--repository", type=Path, required=True, help="the model repository")
    p.add_argument("--pairs", type=Path, help="JSON lines {a, b, same, kind} (default: shipped)")
    p.add_argument("--url", help="embed through a running server's /v1/embeddings instead")
    p.add_argument("--verifier", choices=("rules", "off"), default="rules",
                   help="the verifier whose recommendation --write uses")  # fmt: skip
    p.add_argument("--fit", choices=("all", "dev"), default="all",
                   help="recommend from all pairs, or from two thirds (one held out)")  # fmt: skip
    p.add_argument("--max-false-hits", type=float, default=cal.MAX_FALSE_HIT_RATE,
                   help="bound on the share of near misses served (default 0.01)")  # fmt: skip
    p.add_argument("--write", action="store_true",
                   help="write semantic_threshold into the model's [cache] table")  # fmt: skip
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from fulcrum.cache.verifier import RulesVerifier

    pairs = cal.load_pairs(args.pairs or cal.shipped_pairs())
    embed = _url_embedder(args.url, args.model) if args.url else _local_embedder(args)
    sims = _pair_similarities(pairs, embed)
    scored = cal.score(pairs, sims, RulesVerifier())
    fitted = cal.part(scored, "dev" if args.fit == "dev" else "all")
    verified = args.verifier == "rules"
    chosen = cal.recommend(fitted, verified=verified, max_false_hit_rate=args.max_false_hits)
    print(render(scored, fitted, args.max_false_hits, fit=args.fit))
    if chosen is None:
        print(f"no threshold keeps false hits <= {args.max_false_hits:.1%}", file=sys.stderr)
        return 1
    if args.write:
        _write(args.repository / args.model, chosen)
    return 0


def render(
    scored: Sequence[cal.Scored], fitted: Sequence[cal.Scored], bound: float, *, fit: str
) -> str:
    """The report: thresholds x rates, then per kind at each recommendation, then per split."""
    plain = cal.recommend(fitted, verified=False, max_false_hit_rate=bound)
    ruled = cal.recommend(fitted, verified=True, max_false_hit_rate=bound)
    marks = {t for t in (plain, ruled) if t is not None}
    lines = [
        f"pairs: {len(scored)} ({sum(s.pair.same for s in scored)} paraphrases); "
        f"recommendation fitted on {fit} pairs, false hits <= {bound:.1%}",
        "",
        "| threshold | hit rate | false-hit rate | hit rate (verifier) "
        "| false-hit rate (verifier) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for threshold in sorted({*_SHOWN, *marks}):
        r = cal.rates(scored, threshold)
        star = " *" if threshold in marks else ""
        lines.append(
            f"| {threshold:.3f}{star} | {r.hit_rate:.1%} | {r.false_hit_rate:.1%} "
            f"| {r.hit_rate_verified:.1%} | {r.false_hit_rate_verified:.1%} |"
        )
    for label, chosen in (("without verifier", plain), ("with rules verifier", ruled)):
        lines += ["", f"recommended {label}: " + (f"{chosen:.3f}" if chosen else "none")]
        if chosen is not None:
            lines += _kind_table(scored, chosen) + _split_table(scored, chosen)
    return "\n".join(lines)


def _kind_table(scored: Sequence[cal.Scored], threshold: float) -> list[str]:
    lines = [
        "",
        f"| kind (at {threshold:.3f}) | pairs | served | served (verifier) |",
        "| --- | --- | --- | --- |",
    ]
    for row in cal.per_kind(scored, threshold):
        lines.append(f"| {row.kind} | {row.count} | {row.served:.1%} | {row.served_verified:.1%} |")
    return lines


def _split_table(scored: Sequence[cal.Scored], threshold: float) -> list[str]:
    lines = ["", "| split | hit | false hit | hit (verifier) | false hit (verifier) |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for split in ("dev", "holdout"):
        r = cal.rates(cal.part(scored, split), threshold)
        lines.append(
            f"| {split} | {r.hit_rate:.1%} | {r.false_hit_rate:.1%} "
            f"| {r.hit_rate_verified:.1%} | {r.false_hit_rate_verified:.1%} |"
        )
    return lines


def _pair_similarities(pairs: Sequence[cal.Pair], embed: EmbedFn) -> Array:
    texts = list(dict.fromkeys(t for p in pairs for t in (p.a, p.b)))
    rows = [embed(texts[i : i + _CHUNK]) for i in range(0, len(texts), _CHUNK)]
    matrix = np.concatenate(rows, axis=0)
    row_of = {text: i for i, text in enumerate(texts)}
    left = matrix[[row_of[p.a] for p in pairs]]
    right = matrix[[row_of[p.b] for p in pairs]]
    return cal.similarities(left, right)


def _local_embedder(args: argparse.Namespace) -> EmbedFn:
    """The model loaded in this process, exactly as the server would load its newest version."""
    from fulcrum.backends import create_backend
    from fulcrum.config import load_model_config
    from fulcrum.embeddings import embedding_spec, text_tensor, vectors
    from fulcrum.repository import available_versions

    folder: Path = args.repository / args.model
    config = load_model_config(folder / "config.toml", dir_name=args.model)
    versions = available_versions(folder)
    if not versions:
        raise ConfigError(f"{folder}: no version folder to load")
    backend = create_backend(config, folder / str(versions[-1]))
    spec = embedding_spec(config)

    def embed(texts: list[str]) -> Array:
        tensor = text_tensor(spec, texts, batched=config.max_batch_size > 0)
        out = backend.execute({spec.text_input: tensor})
        return vectors(spec, [out], num_texts=len(texts), dimensions=None)

    return embed


def _url_embedder(url: str, model: str) -> EmbedFn:
    from fulcrum.extras import require

    httpx = require("examples", "httpx", feature="fulcrum cache calibrate --url")
    client = httpx.Client(base_url=url.rstrip("/"), timeout=60.0)

    def embed(texts: list[str]) -> Array:
        response = client.post("/v1/embeddings", json={"model": model, "input": texts})
        if response.status_code != 200:
            raise ConfigError(f"{url}/v1/embeddings: HTTP {response.status_code}: {response.text}")
        data = sorted(response.json()["data"], key=lambda d: d["index"])
        return np.asarray([d["embedding"] for d in data], dtype=np.float32)

    return embed


def _write(folder: Path, threshold: float) -> None:
    from fulcrum.tuning.config_file import edit_config, set_values

    path = folder / "config.toml"

    def edit(document: Any) -> None:
        # Writing into a missing table would switch caching on: that is the user's call.
        if "cache" not in document:
            raise ConfigError(f"{path}: no [cache] table; add one (semantic = true) first")
        set_values({"cache.semantic_threshold": threshold})(document)

    change = edit_config(path, edit)
    print(change.diff or f"{path}: semantic_threshold is already {threshold}")
