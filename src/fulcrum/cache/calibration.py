"""Calibrating the semantic tier: labelled pairs (paraphrase or near miss), their similarities and
verifier verdicts, hit and false-hit rates per threshold, and the lowest threshold whose false
hits stay within the bound. Pure: the embedding is the caller's (calibrate_cli.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from fulcrum.cache.protocols import Verifier
from fulcrum.errors import ConfigError
from fulcrum.types import Array

MAX_FALSE_HIT_RATE = 0.01  # the bound: at most 1% of near misses served
HOLDOUT_EVERY = 3  # pair i is held out when i % 3 == 2: fitted on two thirds, checked on one
GRID = tuple(round(0.5 + 0.005 * i, 3) for i in range(100))  # 0.500 .. 0.995
PARAPHRASE = "paraphrase"  # kinds starting with this are genuine paraphrases
Split = Literal["all", "dev", "holdout"]


class Pair(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One labelled pair: `same` when b's answer may answer a (a paraphrase)."""

    a: str
    b: str
    same: bool
    kind: str


@dataclass(frozen=True, slots=True)
class Scored:
    """A pair with its cosine similarity and the verifier's verdict on it."""

    pair: Pair
    similarity: float
    verified: bool  # the verifier let it through
    reason: str | None  # why not, when it did not
    holdout: bool


@dataclass(frozen=True, slots=True)
class Rates:
    """Served shares at one threshold: of paraphrases (hits) and of near misses (false hits)."""

    threshold: float
    num_same: int
    num_different: int
    hit_rate: float
    false_hit_rate: float
    hit_rate_verified: float
    false_hit_rate_verified: float


@dataclass(frozen=True, slots=True)
class KindRates:
    """For one kind of pair: the share served at a threshold, without and with the verifier."""

    kind: str
    count: int
    served: float
    served_verified: float


def shipped_pairs() -> Path:
    """The labelled set that ships with Fulcrum (src/fulcrum/cache/data/pairs.jsonl)."""
    return Path(str(resources.files("fulcrum.cache").joinpath("data/pairs.jsonl")))


def load_pairs(path: Path) -> list[Pair]:
    """Pairs from a JSON-lines file; a bad line is a ConfigError naming it."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    decoder = msgspec.json.Decoder(Pair)
    pairs: list[Pair] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            pairs.append(decoder.decode(line))
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{path}:{number}: not a pair ({exc})") from exc
    if not any(p.same for p in pairs) or all(p.same for p in pairs):
        raise ConfigError(f"{path}: needs both paraphrases (same) and near misses (not same)")
    return pairs


def similarities(left: Array, right: Array) -> Array:
    """Row-wise cosine similarity of two (N, D) matrices."""
    left = left / np.linalg.norm(left, axis=1, keepdims=True)
    right = right / np.linalg.norm(right, axis=1, keepdims=True)
    products: Array = np.asarray(left, dtype=np.float64) * np.asarray(right, dtype=np.float64)
    return np.asarray(np.sum(products, axis=1), dtype=np.float64)


def score(pairs: Sequence[Pair], sims: Array, verifier: Verifier) -> list[Scored]:
    """Each pair with its similarity and verdict; b plays the cached text, a the new query."""
    scored = []
    for index, (pair, sim) in enumerate(zip(pairs, sims.tolist(), strict=True)):
        verdict = verifier(pair.a, pair.b)
        holdout = index % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
        scored.append(Scored(pair, float(sim), verdict.ok, verdict.reason, holdout))
    return scored


def part(scored: Sequence[Scored], split: Split) -> list[Scored]:
    if split == "all":
        return list(scored)
    return [s for s in scored if s.holdout == (split == "holdout")]


def rates(scored: Sequence[Scored], threshold: float) -> Rates:
    same = [s for s in scored if s.pair.same]
    different = [s for s in scored if not s.pair.same]
    return Rates(
        threshold=threshold,
        num_same=len(same),
        num_different=len(different),
        hit_rate=_share(same, threshold, verified=False),
        false_hit_rate=_share(different, threshold, verified=False),
        hit_rate_verified=_share(same, threshold, verified=True),
        false_hit_rate_verified=_share(different, threshold, verified=True),
    )


def recommend(
    scored: Sequence[Scored], *, verified: bool, max_false_hit_rate: float = MAX_FALSE_HIT_RATE
) -> float | None:
    """The lowest threshold on the grid whose false-hit rate is within the bound (None: none)."""
    different = [s for s in scored if not s.pair.same]
    for threshold in GRID:
        if _share(different, threshold, verified=verified) <= max_false_hit_rate:
            return threshold
    return None


def per_kind(scored: Sequence[Scored], threshold: float) -> list[KindRates]:
    """Paraphrase kinds first, then near-miss kinds, each in the order the file gives."""
    kinds = list(dict.fromkeys(s.pair.kind for s in scored))
    kinds.sort(key=lambda k: not k.startswith(PARAPHRASE))
    rows = []
    for kind in kinds:
        group = [s for s in scored if s.pair.kind == kind]
        rows.append(
            KindRates(
                kind=kind,
                count=len(group),
                served=_share(group, threshold, verified=False),
                served_verified=_share(group, threshold, verified=True),
            )
        )
    return rows


def _share(group: Sequence[Scored], threshold: float, *, verified: bool) -> float:
    if not group:
        return 0.0
    served = sum(1 for s in group if s.similarity >= threshold and (s.verified or not verified))
    return served / len(group)
