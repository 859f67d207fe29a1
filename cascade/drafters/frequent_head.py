"""A drafter model whose LM head keeps a corpus's most frequent tokens only (FR-Spec).

:func:`frequent_head` ranks the vocabulary by frequency in named ``cascade.data`` corpora
(tokenized with the model's tokenizer and cached, the same datastore the suffix drafter
reads) and returns the model with its head cut to the first ``vocab`` ids
(``cascade.models.heads.pruned_head``): a cheaper drafter forward, a drafter that cannot propose
the other ids. Lossless whatever is kept (the target verifies); only acceptance changes.
Usable from a config as a drafter's ``model``:

    model: {_target_: cascade.drafters.frequent_head, model: ${models.small_lm}, vocab: 32768}
"""

from __future__ import annotations

from collections.abc import Sequence

from cascade.drafters.suffix import SEP, corpus_datastore
from cascade.models.lm import CausalLM
from cascade.models.heads.pruned_head import prune_head, rank_by_frequency

DEFAULT_CORPUS = ("humaneval_solutions", "gsm8k_answers")


def frequent_head(model: CausalLM, vocab: int = 32768, corpus: Sequence[str] = DEFAULT_CORPUS) -> CausalLM:
    """``model`` (shared weights, new head) predicting only the ``vocab`` token ids most frequent
    in ``corpus`` (ids the corpus never shows follow in increasing id order), plus EOS."""
    if not 1 <= vocab <= model.vocab_size:
        raise ValueError(f"vocab must lie in [1, {model.vocab_size}], got {vocab}")
    tokens = corpus_datastore(model, list(corpus)).tokens  # [N], documents separated by SEP
    ranked = rank_by_frequency([tokens[tokens != SEP]], model.vocab_size)
    return prune_head(model, ranked[:vocab])
