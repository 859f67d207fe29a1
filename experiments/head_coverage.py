"""How often a drafter's pruned LM head (FR-Spec, ``cascade.drafters.frequent_head``) could not
propose the token its full head ranks first, on text the benchmarks decode.

Scores prompt + canonical solution of the first HumanEval problems (``humaneval_full``: text
like what the benchmark generates) with the drafter's full and pruned heads in one forward each,
and counts the positions whose full-head argmax lies outside the kept ids (those the pruned
drafter cannot draft), how many of those ids already occur in the context up to that position
(what adding the context's ids to the kept set would recover), and checks that everywhere else
the pruned argmax equals the full one.

    python experiments/head_coverage.py --vocab 32768 --num-texts 6
"""

from __future__ import annotations

import argparse

import torch
import transformers

from cascade import load_model
from cascade.data import load_prompts
from cascade.drafters import frequent_head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="fp16w")
    ap.add_argument("--vocab", default="32768,65536", help="comma-separated kept-id counts")
    ap.add_argument("--num-texts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=300, help="tokens scored per text")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    lm = load_model(args.drafter, backend=args.dtype)
    texts = [lm.encode(p.text)[: args.max_tokens] for p in load_prompts("humaneval_full", args.num_texts)]
    full = [lm.forward(ids, lm.new_cache()).argmax(-1) for ids in texts]  # [n] per text
    print(f"{args.drafter} ({args.dtype}), {len(texts)} HumanEval texts (prompt + solution), {sum(map(len, texts))} positions")
    for vocab in (int(v) for v in args.vocab.split(",")):
        pruned = frequent_head(lm, vocab)
        keep = set(pruned.model.lm_head.keep.tolist())
        outside = in_context = differ = 0
        for ids, best in zip(texts, full):
            cut = pruned.forward(ids, pruned.new_cache()).argmax(-1)
            for i, (a, b) in enumerate(zip(best.tolist(), cut.tolist())):
                if a not in keep:
                    outside += 1
                    in_context += a in ids[: i + 1]
                elif a != b:
                    differ += 1
        n = sum(map(len, texts))
        print(f"head {len(keep):6d} ids: full-head argmax outside the kept ids at {outside}/{n} positions "
              f"({100 * outside / n:.1f}%), {in_context} of them already in the context; "
              f"pruned argmax != full argmax where it is kept: {differ}")


if __name__ == "__main__":
    main()
