"""The golden check: the tokens ten methods generate on the tiny models (greedy, and sampled with a
fixed seed) and three methods on the real 1.5B / 0.5B (greedy), written once and compared after
any refactor that must not change behaviour (tests/test_golden.py).

    python tests/golden.py write [--real]   # tests/golden/tiny.json (and real.json)
    python tests/golden.py check [--real]   # exit 1 and the differing cells when any differs

Only APIs every version of cascade since the file was written offers are used (the tiny models
built by ``tiny_llama``, drafters by their constructors, ``generate``), so the same script
writes the file at an old commit and checks it at a new one. DyTC runs priced by its priors
(``measure_costs=False``) without the realised-outcome check, so its trees do not depend on
timings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from cascade import generate  # noqa: E402
from cascade.cascades import HorizontalCascade, VerticalCascade  # noqa: E402
from cascade.drafters import LayerSkipDrafter, NGramDrafter, SmallLMDrafter, TokenRecyclingDrafter  # noqa: E402
from cascade.models import perturbed_copy, tiny_llama  # noqa: E402
from cascade.trees.drafter import TreeDrafter  # noqa: E402
from cascade.trees import DynamicTreePolicy, RerankedTreePolicy, StaticTreePolicy  # noqa: E402
from cascade.types import SamplingConfig

FILES = {"tiny": HERE / "golden" / "tiny.json", "real": HERE / "golden" / "real.json"}
PROMPTS = [[1, 2, 3, 4, 5, 6], [9, 30, 2, 7, 7, 1, 30, 4], [11, 3, 8, 16, 31, 1, 6, 100, 42]]
SETTINGS = {"greedy": {}, "sampled": {"temperature": 1.0, "top_k": 20}}


def tiny_methods(target, close):
    return {
        "ar": lambda: None,
        "sps": lambda: SmallLMDrafter(close, k=4),
        "pld": lambda: NGramDrafter(k=4, max_ngram=2),
        "layer_skip": lambda: LayerSkipDrafter(2, k=3),
        "vertical": lambda: VerticalCascade([SmallLMDrafter(close, k=5), NGramDrafter(k=2)]),
        "horizontal": lambda: HorizontalCascade([(SmallLMDrafter(close, k=2), 2), (NGramDrafter(k=3), 3)]),
        "recycling": lambda: TokenRecyclingDrafter(r=2, k=4),
        "static_tree": lambda: TreeDrafter([SmallLMDrafter(close)], StaticTreePolicy((2, 2, 1))),
        "reranked_tree": lambda: TreeDrafter([SmallLMDrafter(close)], RerankedTreePolicy(top_k=2, depth=3, max_nodes=6)),
        "dytc": lambda: TreeDrafter([SmallLMDrafter(close), NGramDrafter(k=1)],
                                    DynamicTreePolicy(t_min=0.02, max_nodes=12, max_depth=4, max_rank=2, measure_costs=False,
                                                      realised_window=0)),
    }


def tiny_tokens() -> dict:
    torch.set_num_threads(1)
    target = tiny_llama(vocab_size=256, num_layers=4, seed=0, dtype=torch.float64)
    close = perturbed_copy(target, noise=0.05, seed=1)
    out = {}
    for name, make in tiny_methods(target, close).items():
        for setting, kw in SETTINGS.items():
            for i, prompt in enumerate(PROMPTS):
                g = generate(target, prompt, drafter=make(), max_new_tokens=24, stop_on_eos=False, seed=i,
                             sampling=SamplingConfig(**kw))
                out[f"{name}/{setting}/{i}"] = g.tokens
    return out


def real_tokens() -> dict:
    from cascade.data import encode, humaneval
    from cascade.models import load_model

    torch.set_num_threads(2)
    target = load_model("qwen2.5-coder-1.5b")  # the default backend (native where it builds)
    small = load_model("qwen2.5-coder-0.5b")
    prompt = encode(target, humaneval()[0])
    methods = {"ar": None, "sps": SmallLMDrafter(small, k=4), "pld": NGramDrafter(k=6, max_ngram=2)}
    return {f"{name}/greedy/0": generate(target, prompt, drafter=d, max_new_tokens=32).tokens for name, d in methods.items()}


def dumps(tokens: dict) -> str:
    """One cell per line."""
    return "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in tokens.items()) + "\n}\n"


def differences(kind: str) -> list[str]:
    want = json.loads(FILES[kind].read_text())
    got = tiny_tokens() if kind == "tiny" else real_tokens()
    return [cell for cell in sorted(set(want) | set(got)) if want.get(cell) != got.get(cell)]


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("write", "check"):
        print(__doc__)
        return 2
    kinds = ["tiny", "real"] if "--real" in argv else ["tiny"]
    for kind in kinds:
        if argv[0] == "write":
            FILES[kind].parent.mkdir(exist_ok=True)
            FILES[kind].write_text(dumps(tiny_tokens() if kind == "tiny" else real_tokens()))
            print(f"wrote {FILES[kind]}")
        else:
            bad = differences(kind)
            print(f"{kind}: {'identical' if not bad else 'DIFFERENT: ' + ', '.join(bad)}")
            if bad:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
