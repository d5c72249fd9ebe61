"""How far a reference's answer agrees with the caller's, per row, averaged over the request:
cosine similarity (embeddings, float outputs), top-1 agreement (the argmax of a classifier's
scores) and exact agreement (token ids, labels). 1.0: full agreement; answers of different
shapes agree 0.0."""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

from fulcrum.types import Array

Compare = Literal["", "cosine", "top1", "exact"]  # "": cosine


def agreement(compare: Compare, caller: Array, reference: Array, *, batched: bool) -> float:
    """The mean per-row agreement of two answers of one output (`batched`: axis 0 is rows)."""
    if caller.shape != reference.shape or caller.size == 0:
        return 0.0
    rows = caller.shape[0] if batched and caller.ndim > 0 else 1
    a, b = caller.reshape(rows, -1), reference.reshape(rows, -1)  # (R, N)
    if compare == "exact":
        return float(np.mean([np.array_equal(x, y) for x, y in zip(a, b, strict=True)]))
    if compare == "top1":
        return float(np.mean(np.argmax(a, axis=1) == np.argmax(b, axis=1)))
    return _cosine(a.astype(np.float64), b.astype(np.float64))


def token_agreement(caller: list[int], reference: list[int]) -> float:
    """Exact-token agreement of two greedy generations: the share of the longer one that both
    share from the start (after the first different token, greedy outputs no longer compare)."""
    longest = max(len(caller), len(reference))
    if longest == 0:
        return 1.0
    prefix = next(
        (i for i, (a, b) in enumerate(zip(caller, reference, strict=False)) if a != b), None
    )
    same = min(len(caller), len(reference)) if prefix is None else prefix
    return same / longest


def _cosine(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> float:
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)  # (R,)
    dots = np.sum(a * b, axis=1)
    both_zero = (np.linalg.norm(a, axis=1) == 0) & (np.linalg.norm(b, axis=1) == 0)
    # Two zero rows agree; one zero row against another row does not.
    cosines = np.where(both_zero, 1.0, dots / np.maximum(norms, 1e-300))
    return float(np.mean(np.clip(cosines, -1.0, 1.0)))
