"""Calibration arithmetic on hand-made similarities, and the shipped labelled set's shape."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fulcrum.cache import calibration as cal
from fulcrum.cache.protocols import Verdict
from fulcrum.errors import ConfigError

NEAR_MISS_KINDS = {"number", "unit", "negation", "antonym", "entity", "scope", "order", "topic"}
PARAPHRASE_KINDS = {"paraphrase-typo", "paraphrase-synonym", "paraphrase-reorder",
                    "paraphrase-casual"}  # fmt: skip


class RefuseOrders:
    """Refuses every pair whose b contains 'swap'."""

    def __call__(self, query: str, candidate: str) -> Verdict:
        return Verdict(False, "order") if "swap" in candidate else Verdict(True)


def pairs_of(rows: list[tuple[bool, str, str]]) -> list[cal.Pair]:
    return [
        cal.Pair(a=f"a{i}", b=b, same=same, kind=kind) for i, (same, kind, b) in enumerate(rows)
    ]


PAIRS = pairs_of([
    (True, "paraphrase-typo", "b"), (True, "paraphrase-typo", "b"),
    (True, "paraphrase-casual", "b"), (True, "paraphrase-casual", "b"),
    (False, "order", "swap"), (False, "order", "swap"),
    (False, "topic", "b"), (False, "topic", "b"),
])  # fmt: skip
SIMS = np.array([0.95, 0.80, 0.70, 0.60, 0.999, 0.97, 0.75, 0.65])


def test_rates_count_served_pairs_with_and_without_the_verifier() -> None:
    scored = cal.score(PAIRS, SIMS, RefuseOrders())
    r = cal.rates(scored, 0.7)
    assert (r.num_same, r.num_different) == (4, 4)
    assert (r.hit_rate, r.false_hit_rate) == (0.75, 0.75)  # 3 of 4 paraphrases, 3 of 4 misses
    assert (r.hit_rate_verified, r.false_hit_rate_verified) == (0.75, 0.25)  # swaps refused


def test_recommend_is_the_lowest_threshold_within_the_bound() -> None:
    scored = cal.score(PAIRS, SIMS, RefuseOrders())
    assert cal.recommend(scored, verified=True, max_false_hit_rate=0.0) == 0.755
    assert cal.recommend(scored, verified=True, max_false_hit_rate=0.25) == 0.655
    assert cal.recommend(scored, verified=False, max_false_hit_rate=0.0) is None  # 0.999 > grid
    assert cal.recommend(scored, verified=False, max_false_hit_rate=0.25) == 0.975


def test_per_kind_lists_paraphrases_first() -> None:
    scored = cal.score(PAIRS, SIMS, RefuseOrders())
    rows = cal.per_kind(scored, 0.7)
    assert [r.kind for r in rows] == ["paraphrase-typo", "paraphrase-casual", "order", "topic"]
    order = rows[2]
    assert (order.count, order.served, order.served_verified) == (2, 1.0, 0.0)


def test_every_third_pair_is_held_out() -> None:
    scored = cal.score(PAIRS, SIMS, RefuseOrders())
    assert [s.holdout for s in scored] == [False, False, True] * 2 + [False, False]
    assert len(cal.part(scored, "dev")) == 6 and len(cal.part(scored, "holdout")) == 2


def test_similarities_are_row_wise_cosines() -> None:
    left = np.array([[1.0, 0.0], [3.0, 4.0]])
    right = np.array([[2.0, 0.0], [4.0, -3.0]])
    np.testing.assert_allclose(cal.similarities(left, right), [1.0, 0.0], atol=1e-12)


def test_a_bad_line_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"a": "x", "b": "y", "same": true, "kind": "k"}\n{"a": "x"}\n')
    with pytest.raises(ConfigError, match=r"pairs.jsonl:2: not a pair"):
        cal.load_pairs(path)


def test_a_set_without_near_misses_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"a": "x", "b": "y", "same": true, "kind": "k"}\n')
    with pytest.raises(ConfigError, match="needs both"):
        cal.load_pairs(path)


def test_the_shipped_set_has_hundreds_of_pairs_of_every_kind() -> None:
    pairs = cal.load_pairs(cal.shipped_pairs())
    kinds = Counter(p.kind for p in pairs)
    assert set(kinds) == NEAR_MISS_KINDS | PARAPHRASE_KINDS
    assert len(pairs) >= 300 and min(kinds.values()) >= 25
    assert all(p.same == p.kind.startswith("paraphrase") for p in pairs)
    assert len({(p.a, p.b) for p in pairs}) == len(pairs)  # no duplicates
    lines = cal.shipped_pairs().read_text(encoding="utf-8").splitlines()
    assert all(set(json.loads(line)) == {"a", "b", "same", "kind"} for line in lines)
