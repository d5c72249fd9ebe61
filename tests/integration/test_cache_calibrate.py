"""`fulcrum cache calibrate` on a small pairs file with the real MiniLM ONNX model: the report,
the verifier's effect on a swapped-roles pair, and `--write` into the model's `[cache]` table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fulcrum.cache import calibration as cal
from fulcrum.cli import main
from fulcrum.config import load_model_config

PAIRS = [
    {"a": "How do I reset my password?", "b": "how do i reset my pasword", "same": True,
     "kind": "paraphrase-typo"},
    {"a": "In Python, how do I reverse a list?", "b": "How do I reverse a list in Python?",
     "same": True, "kind": "paraphrase-reorder"},
    {"a": "Where is my order?", "b": "Where is my order right now?", "same": True,
     "kind": "paraphrase-casual"},
    {"a": "Convert USD to EUR", "b": "Convert EUR to USD", "same": False, "kind": "order"},
    {"a": "Is it safe to eat raw eggs?", "b": "Is it unsafe to eat raw eggs?", "same": False,
     "kind": "negation"},
    {"a": "Weather in Paris today", "b": "Weather in London today", "same": False,
     "kind": "entity"},
]  # fmt: skip
CACHE_TABLE = "\n[cache]\n# semantic hits for paraphrased questions\nsemantic = true\n"


@pytest.fixture
def pairs_file(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return path


def repository_copy(example_repo: Path, tmp_path: Path, extra_config: str) -> Path:
    """minilm with a config of our own (the example repository is shared and read-only)."""
    folder = tmp_path / "repo" / "minilm"
    folder.mkdir(parents=True)
    (folder / "1").symlink_to(example_repo / "minilm" / "1", target_is_directory=True)
    text = (example_repo / "minilm" / "config.toml").read_text()
    (folder / "config.toml").write_text(text + extra_config)
    return folder.parent


def recommended(output: str) -> float:
    match = re.search(r"recommended with rules verifier: ([0-9.]+)", output)
    assert match is not None, output
    return float(match.group(1))


def test_the_report_shows_the_verifier_refusing_near_misses_minilm_scores_alike(
    example_repo: Path, pairs_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["cache", "calibrate", "--repository", str(example_repo), "--pairs", str(pairs_file)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "pairs: 6 (3 paraphrases)" in out
    # MiniLM scores the swapped roles above every threshold shown; only the verifier refuses it.
    assert re.search(r"\| order \| 1 \| 100\.0% \| 0\.0% \|", out), out
    threshold = recommended(out)
    unverified = re.search(r"recommended without verifier: ([0-9.]+)", out)
    assert unverified is not None and float(unverified.group(1)) > 0.95 > threshold
    assert threshold in cal.GRID
    assert re.search(rf"\| {threshold:.3f} \* \| [0-9.]+% \| [0-9.]+% \| [0-9.]+% \| 0\.0% \|", out)


def test_write_sets_the_threshold_and_keeps_comments(
    example_repo: Path, pairs_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = repository_copy(example_repo, tmp_path, CACHE_TABLE)
    argv = ["cache", "calibrate", "minilm", "--repository", str(repo), "--pairs", str(pairs_file),
            "--write"]  # fmt: skip
    assert main(argv) == 0
    threshold = recommended(capsys.readouterr().out)
    text = (repo / "minilm" / "config.toml").read_text()
    assert "# semantic hits for paraphrased questions" in text
    config = load_model_config(repo / "minilm" / "config.toml", dir_name="minilm")
    assert config.cache is not None and config.cache.semantic
    assert config.cache.semantic_threshold == threshold


def test_write_refuses_a_model_without_a_cache_table(
    example_repo: Path, pairs_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = repository_copy(example_repo, tmp_path, "")
    before = (repo / "minilm" / "config.toml").read_text()
    argv = ["cache", "calibrate", "minilm", "--repository", str(repo), "--pairs", str(pairs_file),
            "--write"]  # fmt: skip
    assert main(argv) == 2
    assert "no [cache] table" in capsys.readouterr().err
    assert (repo / "minilm" / "config.toml").read_text() == before
