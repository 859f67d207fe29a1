"""The table of values a run checks before any model loads.

One row per kind of value: the config keys it covers (leaf names, wherever they sit: the run's
top level, ``sampling``, ``dataset`` and every method's subtree), what the value must be, and
whether null is allowed. ``config_errors(cfg)`` walks the resolved config and returns one message
per bad value, naming its full key and the value; ``cascade.run.validate`` raises them before
loading anything. Constructors keep their own checks (a drafter built in Python is checked
there); this table is what makes a typo on the command line fail in a second instead of after a
minute of loading a 1.5B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from omegaconf import DictConfig, OmegaConf


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Rule:
    keys: tuple[str, ...]  # leaf names this row covers
    ok: Callable[[object], bool]
    expected: str  # said in the error
    nullable: bool = False


RULES: tuple[Rule, ...] = (
    Rule(("temperature",), lambda v: _number(v) and v >= 0, "a finite number >= 0 (0: greedy)"),
    Rule(("top_k",), lambda v: _integer(v) and v >= 1, "a positive integer or null", nullable=True),
    Rule(("top_p",), lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1] or null", nullable=True),
    Rule(("k", "chain_k", "max_new_tokens", "max_nodes", "max_depth", "max_rank", "depth", "tokens", "r", "threads",
          "per_category", "max_ngram", "min_ngram", "max_matches"),
         lambda v: _integer(v) and v >= 1, "a positive integer"),
    Rule(("num_prompts",), lambda v: _integer(v) and v >= 1, "a positive integer or null (all)", nullable=True),
    Rule(("explore", "probe", "realised_window", "chain_drafter"), lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    Rule(("seed",), _integer, "an integer"),
    Rule(("t_min", "margin", "min_gain", "realised_margin"), lambda v: _number(v) and v >= 0, "a finite number >= 0"),
    Rule(("stop_below", "chain_stop_below"), lambda v: _number(v) and 0 <= v <= 1, "a probability in [0, 1] or null", nullable=True),
)
_RULE_OF = {key: rule for rule in RULES for key in rule.keys}


def _leaves(node, prefix: str):
    """(dotted key, value) of every leaf under ``node`` (a plain container)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{prefix}[{i}]")
    else:
        yield prefix, node


def value_errors(values: dict, prefix: str = "") -> list[str]:
    """One message per value of ``values`` (a plain nested dict) that breaks its row of ``RULES``."""
    errors = []
    for key, value in _leaves(values, prefix):
        rule = _RULE_OF.get(key.rsplit(".", 1)[-1].split("[")[0])
        if rule is None or (value is None and rule.nullable) or rule.ok(value):
            continue
        errors.append(f"{key}={value!r}: must be {rule.expected}")
    return errors


def config_errors(cfg: DictConfig, methods: dict[str, DictConfig]) -> list[str]:
    """Every bad value in the run's top level, ``sampling``, ``dataset`` and each method's config
    (``methods``: name -> config), resolved as the run will see them."""
    errors = value_errors({k: cfg.get(k) for k in ("seed", "threads")})
    for section in ("sampling", "dataset"):
        node = OmegaConf.select(cfg, section)
        if isinstance(node, DictConfig):
            errors += value_errors(OmegaConf.to_container(node, resolve=True), section)
    for name, mcfg in methods.items():
        errors += value_errors(OmegaConf.to_container(mcfg, resolve=True), f"methods.{name}")
    return errors
