"""Bad input fails before any model loads, naming the field and the value; the evaluation reserve
is enforced; every row of the validation table is exercised."""

import math

import pytest
from hydra import compose, initialize_config_dir

from cascade import run as run_mod
from cascade import data
from cascade.types import SamplingConfig
from cascade.validation import RULES, value_errors

from tests.test_experiments import CONF


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


# (override, the key the error must name, the bad value as the error prints it)
BAD = [
    ("sampling.temperature=nan", "sampling.temperature", "nan"),
    ("sampling.temperature=inf", "sampling.temperature", "inf"),
    ("sampling.temperature=-1", "sampling.temperature", "-1"),
    ("sampling.temperature=hot", "sampling.temperature", "'hot'"),
    ("sampling.top_k=0", "sampling.top_k", "0"),
    ("sampling.top_k=2.5", "sampling.top_k", "2.5"),
    ("sampling.top_p=nan", "sampling.top_p", "nan"),
    ("sampling.top_p=1.5", "sampling.top_p", "1.5"),
    ("method.drafter.k=0", "methods.pld.drafter.k", "0"),
    ("method.drafter.k=-3", "methods.pld.drafter.k", "-3"),
    ("method.drafter.k=four", "methods.pld.drafter.k", "'four'"),
    ("method.drafter.k=true", "methods.pld.drafter.k", "True"),
    ("dataset.max_new_tokens=0", "dataset.max_new_tokens", "0"),
    ("dataset.max_new_tokens=nan", "dataset.max_new_tokens", "nan"),
    ("dataset.num_prompts=0", "dataset.num_prompts", "0"),
    ("threads=0", "threads", "0"),
    ("seed=1.5", "seed", "1.5"),
]


@pytest.mark.parametrize("override, key, shown", BAD, ids=[b[0] for b in BAD])
def test_bad_value_is_refused_before_any_model_loads(override, key, shown, no_model_loading, tmp_path):
    cfg = _cfg("+experiment=pld", "debug=tiny", override, f"output_dir={tmp_path}")
    with pytest.raises(run_mod.ConfigError) as err:
        run_mod.run(cfg)
    assert f"{key}={shown}" in str(err.value)


@pytest.mark.parametrize("override, key, shown", [
    ("method.drafter.policy.max_nodes=0", "methods.dytc_tree.drafter.policy.max_nodes", "0"),
    ("method.drafter.policy.t_min=nan", "methods.dytc_tree.drafter.policy.t_min", "nan"),
    ("method.drafter.policy.explore=-1", "methods.dytc_tree.drafter.policy.explore", "-1"),
    ("method.drafter.drafters.1.k=0", "methods.dytc_tree.drafter.drafters[1].k", "0"),
])
def test_budgets_inside_a_method_are_checked(override, key, shown, no_model_loading, tmp_path):
    cfg = _cfg("+experiment=dytc_tree", "debug=tiny", override, f"output_dir={tmp_path}")
    with pytest.raises(run_mod.ConfigError) as err:
        run_mod.run(cfg)
    assert f"{key}={shown}" in str(err.value)


def test_every_rule_accepts_a_good_value_and_names_a_bad_one():
    good = {"temperature": 0.5, "top_k": 3, "top_p": 0.9, "k": 4, "max_new_tokens": 4, "max_nodes": 4,
            "max_depth": 4, "max_rank": 2, "depth": 3, "tokens": 2, "r": 8, "threads": 2, "per_category": 1,
            "realised_window": 32, "max_ngram": 3, "min_ngram": 1, "max_matches": 64, "num_prompts": 5,
            "explore": 0, "probe": 16, "seed": 0, "t_min": 0.7, "margin": 1.0, "realised_margin": 2.0, "min_gain": 0.0, "chain_k": 8, "chain_drafter": 1, "chain_stop_below": 0.4,
            "stop_below": 0.4}
    keys = {k for rule in RULES for k in rule.keys}
    assert keys == set(good), "every key of the table has a good value here"
    assert value_errors(good) == []
    for key in keys:
        bad = value_errors({key: math.nan})
        assert bad == [f"{key}=nan: must be {next(r.expected for r in RULES if key in r.keys)}"]


def test_an_integer_temperature_is_the_number_it_names():
    s = SamplingConfig(temperature=2, top_p=1)
    assert s.temperature == 2.0 and isinstance(s.temperature, float) and isinstance(s.top_p, float)
    for bad in (math.nan, math.inf, "1.0", True):
        with pytest.raises(ValueError, match="temperature"):
            SamplingConfig(temperature=bad)


def test_an_integer_temperature_runs(tmp_path):
    cfg = _cfg("+experiment=pld", "debug=tiny", "sampling=sample", "sampling.temperature=2", "progress=false",
               f"output_dir={tmp_path}")
    summary = run_mod.run(cfg)
    assert summary.methods["pld"].tokens


def test_duplicate_jsonl_ids_are_refused(no_model_loading, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n{"id": "a", "prompt": "z"}\n')
    cfg = _cfg("+experiment=pld", "dataset=jsonl", f"dataset.path={path}", f"output_dir={tmp_path}")
    with pytest.raises(ValueError, match=r"p.jsonl:3: prompt id 'a' repeats line 1's"):
        run_mod.run(cfg)


# -- the evaluation reserve ---------------------------------------------------------------------

def test_prompts_inside_the_reserve_overlap_no_corpus():
    held = data.humaneval()[:40] + data.gsm8k()[:200] + data.gsm8k()[1000:]
    assert data.reserve_overlap(held, list(data.HEAD_CORPORA) + ["gsm8k_answers"]) == {}


def test_prompts_outside_the_reserve_are_found_in_the_corpora_that_hold_them():
    outside = data.humaneval()[38:42] + data.gsm8k()[199:201]
    overlap = data.reserve_overlap(outside, ["humaneval_solutions", "gsm8k_answers", "continuations"])
    assert overlap == {"humaneval_solutions": ["HumanEval/40", "HumanEval/41"], "gsm8k_answers": ["gsm8k/200"],
                       "continuations": ["HumanEval/40", "HumanEval/41", "gsm8k/200"]}


def test_a_suffix_run_past_the_reserve_is_refused(no_model_loading, tmp_path):
    cfg = _cfg("+experiment=suffix", "dataset=humaneval", "dataset.num_prompts=42", f"output_dir={tmp_path}")
    with pytest.raises(run_mod.ConfigError, match=r"'suffix' reads corpora that hold evaluated prompts: "
                                                  r"humaneval_solutions holds HumanEval/40, HumanEval/41 \(2\)"):
        run_mod.run(cfg)


def test_a_trained_heads_method_counts_every_head_source():
    cfg = _cfg("+experiment=eagle_chain", "models.head=/some/head.pt")
    assert run_mod.method_corpora(cfg.method) == list(data.HEAD_CORPORA)
    untrained = _cfg("+experiment=eagle_chain", "debug=tiny")
    assert run_mod.method_corpora(untrained.method) == []
