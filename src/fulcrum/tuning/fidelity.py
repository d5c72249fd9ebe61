"""How faithful a quantized variant is to its reference: pure numpy metrics over the outputs of
both on the same validation rows. Cosine similarity for embeddings, top-1 agreement for
classifiers, task accuracy when the rows carry labels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fulcrum.errors import InvalidInput
from fulcrum.types import Array, TensorMap

METRICS = ("auto", "cosine", "top1", "accuracy")
# Output names that mark a classifier head (scores over classes, one winner per row).
_CLASSIFIER_WORDS = ("logit", "prob", "score", "class", "label")


@dataclass(frozen=True, slots=True)
class Fidelity:
    """One figure of agreement (1.0: identical) and what it measures."""

    value: float
    metric: str  # "cosine", "top1" or "accuracy"
    worst_row: float | None = None  # cosine: the least similar row
    perplexity_ratio: float | None = None  # LLMs: variant / reference perplexity


def cosine(reference: Array, variant: Array) -> Fidelity:
    """Mean cosine similarity of each row (flattened past axis 0) of two equal-shape outputs.
    Two all-zero rows count as identical; one zero row against a non-zero one as 0."""
    ref, var = _rows(reference, variant)  # (N, D)
    dot = np.sum(ref * var, axis=1)
    norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(var, axis=1)
    both_zero = (np.linalg.norm(ref, axis=1) == 0) & (np.linalg.norm(var, axis=1) == 0)
    safe = np.where(norms > 0, norms, 1.0)
    sims = np.where(both_zero, 1.0, np.where(norms > 0, dot / safe, 0.0))  # (N,)
    return Fidelity(float(sims.mean()), "cosine", worst_row=float(sims.min()))


def top1_agreement(reference: Array, variant: Array) -> Fidelity:
    """The fraction of rows whose highest-scoring class is the same in both outputs."""
    ref, var = _rows(reference, variant)  # (N, C)
    agree = np.argmax(ref, axis=1) == np.argmax(var, axis=1)  # (N,)
    return Fidelity(float(agree.mean()), "top1")


def accuracy(outputs: Array, labels: Sequence[int]) -> Fidelity:
    """The fraction of rows whose highest-scoring class index equals its label."""
    scores = _as_rows(outputs)  # (N, C)
    if len(labels) != len(scores):
        raise InvalidInput(f"{len(labels)} labels for {len(scores)} rows of output")
    predicted = np.argmax(scores, axis=1)
    return Fidelity(float(np.mean(predicted == np.asarray(labels))), "accuracy")


def choose_metric(output_name: str, reference: Array, *, has_labels: bool) -> str:
    """`auto` made concrete: accuracy with labels; top-1 for a classifier head (named like one,
    or rows of probabilities); else cosine, which also suits any dense output."""
    if has_labels:
        return "accuracy"
    rows = _as_rows(reference)
    if rows.shape[1] > 1 and any(word in output_name.lower() for word in _CLASSIFIER_WORDS):
        return "top1"
    if rows.shape[1] > 1 and np.all(rows >= 0) and np.allclose(rows.sum(axis=1), 1.0, atol=1e-3):
        return "top1"  # softmax output
    return "cosine"


def compare(
    reference: TensorMap,
    variant: TensorMap,
    *,
    metric: str = "auto",
    labels: Sequence[int] | None = None,
) -> Fidelity:
    """The variant's fidelity over every output: the worst output's figure. With `accuracy`,
    the figure is the variant's accuracy relative to the reference's (1.0: as accurate)."""
    if metric not in METRICS:
        raise InvalidInput(f"fidelity metric {metric!r}: expected one of {list(METRICS)}")
    missing = sorted(set(reference) - set(variant))
    if missing:
        raise InvalidInput(f"the variant did not return outputs {missing}")
    figures = [_one(name, reference[name], variant[name], metric, labels) for name in reference]
    return min(figures, key=lambda f: f.value)


def _one(name: str, ref: Array, var: Array, metric: str, labels: Sequence[int] | None) -> Fidelity:
    chosen = metric if metric != "auto" else choose_metric(name, ref, has_labels=bool(labels))
    if chosen == "cosine":
        return cosine(ref, var)
    if chosen == "top1":
        return top1_agreement(ref, var)
    if not labels:
        raise InvalidInput("the accuracy metric needs a 'label' on every validation row")
    ref_acc = accuracy(ref, labels).value
    var_acc = accuracy(var, labels).value
    # Relative, so one bound (--min-fidelity) reads the same for every metric.
    return Fidelity(var_acc / ref_acc if ref_acc > 0 else float(var_acc == 0), "accuracy")


Rows = npt.NDArray[np.float64]  # (N, D)


def _rows(reference: Array, variant: Array) -> tuple[Rows, Rows]:
    if reference.shape != variant.shape:
        raise InvalidInput(f"output shapes differ: {reference.shape} vs {variant.shape}")
    return _as_rows(reference), _as_rows(variant)


def _as_rows(array: Array) -> Rows:
    values = np.asarray(array, dtype=np.float64)
    if values.ndim == 0:
        return values.reshape(1, 1)
    return values.reshape(len(values), -1)  # (N, D)


def passes(fidelity: Fidelity, min_fidelity: float) -> bool:
    """Whether the figure meets the user's bound."""
    return fidelity.value >= min_fidelity
