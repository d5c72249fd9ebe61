"""`[routing]` in config.toml: a valid table decodes, and each error names its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from fulcrum.config import ModelConfig, load_model_config
from fulcrum.errors import ConfigError

BASE = """platform = "echo"
max_batch_size = 8
inputs = [{name = "x", datatype = "FP32", shape = [1]}]
outputs = [{name = "x", datatype = "FP32", shape = [1]}]
[variants.fp32]
[variants.int8]
[variants.int4]
load = false
"""


def load(tmp_path: Path, text: str, base: str = BASE) -> ModelConfig:
    path = tmp_path / "m" / "config.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(base + text)
    return load_model_config(path, dir_name="m")


def test_a_full_routing_table_decodes(tmp_path: Path) -> None:
    config = load(tmp_path, """
[routing]
ab = { arms = { fp32 = 0.9, int8 = 0.1 } }
shadow = { variant = "fp32", fraction = 0.05, max_in_flight = 4, compare = "top1" }
cascade = { then = "big", score_output = "x", threshold = 0.8 }
""")  # fmt: skip
    routing = config.routing
    assert routing.ab is not None and routing.ab.arms == {"fp32": 0.9, "int8": 0.1}
    assert routing.shadow is not None and routing.shadow.compare == "top1"
    assert routing.cascade is not None and routing.cascade.higher_is_confident


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ("[routing.ab]\narms = {}", "key 'routing.ab.arms'"),
        ("[routing.ab]\narms = { fp32 = -1.0 }", "key 'routing.ab.arms.fp32' = -1.0"),
        ("[routing.ab]\narms = { fp32 = nan }", "key 'routing.ab.arms.fp32' = nan"),
        ("[routing.ab]\narms = { int4 = 1.0 }", "key 'routing.ab.arms.int4': not a loaded"),
        ("[routing.ab]\narms = { fp32 = 0.0 }", "key 'routing.ab.arms': the weights sum to 0"),
        ('[routing.ab]\nby = "version"\narms = { v1 = 1.0 }', "key 'routing.ab.arms.v1'"),
        ('[routing.ab]\nby = "lane"\narms = { fp32 = 1.0 }', "routing.ab.by"),
        ("[routing.ab]\nweights = {}", "key 'routing.ab': Object contains unknown field `weights`"),
        ("[routing.shadow]\nfraction = 0.5", "key 'routing.shadow': name the reference"),
        ('[routing.shadow]\nvariant = "int4"', "key 'routing.shadow.variant' = 'int4'"),
        ('[routing.shadow]\nvariant = "fp32"\nfraction = 1.5', "key 'routing.shadow.fraction'"),
        ('[routing.shadow]\nvariant = "fp32"\nmax_in_flight = 0',
         "key 'routing.shadow.max_in_flight' = 0"),
        ('[routing.shadow]\nvariant = "fp32"\ntimeout_ms = 0', "key 'routing.shadow.timeout_ms'"),
        ('[routing.shadow]\nvariant = "fp32"\noutput = "y"', "key 'routing.shadow.output' = 'y'"),
        ('[routing.shadow]\nvariant = "fp32"\ncompare = "l2"', "routing.shadow.compare"),
        ('[routing.cascade]\nthen = "m"\nscore_output = "x"\nthreshold = 0.5',
         "key 'routing.cascade.then' = 'm'"),
        ('[routing.cascade]\nthen = "../x"\nscore_output = "x"\nthreshold = 0.5',
         "key 'routing.cascade.then'"),
        ('[routing.cascade]\nthen = "big"\nscore_output = "p"\nthreshold = 0.5',
         "key 'routing.cascade.score_output' = 'p'"),
        ('[routing.cascade]\nthen = "big"\nscore_output = "x"\nthreshold = inf',
         "key 'routing.cascade.threshold' = inf"),
        ('[routing.cascade]\nthen = "big"\nscore_output = "x"', "routing.cascade"),
        ('[routing.cascade]\nthen = "big"\nthreshold = 0.5',
         "key 'routing.cascade.score_output' = ''"),
        ('[routing.cascade]\nthen = "big"\nscore_output = "x"\nthreshold = 0.5\n'
         'score = "min_logprob"', "key 'routing.cascade.score' = 'min_logprob'"),
    ],
)  # fmt: skip
def test_each_error_names_its_key(tmp_path: Path, table: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, table)
    assert key in caught.value.message


LLM = 'platform = "llm"\n[variants.fp32]\n[variants.int8]\n'


def test_a_generative_model_takes_a_split_by_variant_only(tmp_path: Path) -> None:
    config = load(tmp_path, "[routing.ab]\narms = { fp32 = 1.0, int8 = 1.0 }", LLM)
    assert config.routing.ab is not None
    for table, key in (
        ('[routing.ab]\nby = "version"\narms = { 1 = 1.0 }', "key 'routing.ab.by'"),
        ('[routing.shadow]\nvariant = "fp32"\ncompare = "cosine"', "key 'routing.shadow.compare'"),
        ('[routing.cascade]\nthen = "b"\nscore_output = "x"\nthreshold = 1', "routing.cascade"),
    ):
        with pytest.raises(ConfigError) as caught:
            load(tmp_path, table, LLM)
        assert key in caught.value.message


def test_a_generative_cascade_is_scored_by_its_logprobs(tmp_path: Path) -> None:
    table = '[routing.cascade]\nthen = "big"\nthreshold = -1.5'
    default = load(tmp_path, table, LLM).routing.cascade
    assert default is not None and default.generation_score == "mean_logprob"
    chosen = load(tmp_path, table + '\nscore = "min_logprob"', LLM).routing.cascade
    assert chosen is not None and chosen.generation_score == "min_logprob"
    for bad, key in (
        ('[routing.cascade]\nthen = "big"\nthreshold = 0.5',
         "key 'routing.cascade.threshold' = 0.5"),
        ('[routing.cascade]\nthen = "big"\nthreshold = -1\nscore = "perplexity"',
         "routing.cascade.score"),
        ('[routing.cascade]\nthen = "big"\nscore_output = "x"\nthreshold = -1',
         "key 'routing.cascade.score_output' = 'x'"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as caught:
            load(tmp_path, bad, LLM)
        assert key in caught.value.message
