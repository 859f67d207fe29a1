"""No corpus, datastore or training set holds an evaluation prompt.

The reserve (``cascade.data.RESERVED_HUMANEVAL`` / ``RESERVED_GSM8K``): HumanEval problems 0-39 and
GSM8K test items 0-199 and 1000-1318. Every text source a drafter or a training run can read is
checked here: the plain corpora (suffix datastores, pruned heads, head training), the question
sets of head training, and the sources the shipped configs name.
"""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from cascade import data

CONF = str((Path(__file__).parents[1] / "conf").resolve())


@pytest.fixture(scope="module")
def reserved():
    rows = data._humaneval_rows()
    gsm = data._jsonl(data._read_member(data._GSM8K))
    texts = [rows[i]["prompt"] for i in data.RESERVED_HUMANEVAL]
    texts += [rows[i]["canonical_solution"] for i in data.RESERVED_HUMANEVAL]
    texts += [gsm[i]["question"] for r in data.RESERVED_GSM8K for i in r]
    assert len(texts) == 40 + 40 + 200 + 319
    return texts


def _leaks(texts, reserved):
    return [(i, r[:60]) for i, t in enumerate(texts) for r in reserved if r in t]


@pytest.mark.parametrize("name", data.CORPORA)
def test_corpora_exclude_the_reserve(name, reserved):
    texts = data.corpus(name)
    assert texts, name
    assert not _leaks(texts, reserved)


@pytest.mark.parametrize("name", data.QA_SETS)
def test_question_sets_exclude_the_reserve(name, reserved):
    pairs = data.qa_pairs(name)
    assert pairs, name
    assert not _leaks([q + "\n" + a for q, a in pairs], reserved)


def test_continuation_prompts_exclude_the_reserve(reserved):
    prompts = data.continuation_prompts()
    assert {p.category for p in prompts} == {"code", "math", "qa", "mtbench"}
    assert not _leaks([p.text for p in prompts], reserved)


def test_the_check_sees_a_leak(reserved):
    """The same check flags a text that quotes one reserved item (HumanEval 0, GSM8K 1000)."""
    assert _leaks(["x" + reserved[0] + "y"], reserved)
    assert _leaks([reserved[-1]], reserved)


def test_gsm8k_corpus_is_items_200_to_999():
    gsm = data._jsonl(data._read_member(data._GSM8K))
    pairs = data.qa_pairs("gsm8k_qa")
    assert [q for q, _ in pairs] == [gsm[i]["question"] for i in range(200, 1000)]


def _names(node) -> set[str]:
    """Every corpus / source name a config node mentions (corpus lists, training sources)."""
    found = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "corpus" and isinstance(value, list):
                found.update(value)
            elif key == "sources" and isinstance(value, dict):
                found.update(value)
            else:
                found |= _names(value)
    elif isinstance(node, list):
        for value in node:
            found |= _names(value)
    return found


def test_configs_name_only_checked_sources():
    known = set(data.CORPORA) | set(data.QA_SETS) | {data.CONTINUATIONS}
    used = set()
    for path in sorted((Path(CONF) / "method").glob("*.yaml")):
        used |= _names(OmegaConf.to_container(OmegaConf.load(path)))
    for path in sorted((Path(CONF) / "experiment").rglob("*.yaml")):
        used |= _names(OmegaConf.to_container(OmegaConf.load(path)))
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        used |= _names(OmegaConf.to_container(compose("train_head")))
    assert used, "the configs name corpora"
    assert used <= known, used - known
