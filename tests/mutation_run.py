"""Mutation run: each broken double of ``tests/broken_doubles.py`` applied as a one- or two-line
change to a *copy of the real code*, and the default test suite run against the copy.

The doubles reach the code through seams (a ``Verifier`` field, a drafter subclass); a mutant
edits the real module instead, so it also shows that nothing between the seam and the decode
loop hides the bug. Per mutant: copy the working tree (without ``.venv``, Hydra outputs, caches) to a
scratch folder, apply the edit (the original line must occur exactly once), check that the copy's
``cascade`` is the one imported, then run the default suite's losslessness files
(``TARGETED``, stopping at the first failure); a mutant they do not catch is run against the
whole default suite before it is called survived. A failure in either is a failure of the
default suite.

    python tests/mutation_run.py [--only NAME ...] [--targeted-only] [--log results/tests/mutation_run.log]

Prints one row per mutant: caught / survived, the first failing test, the minutes it took.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETED = ["tests/test_verify_rules.py", "tests/test_lossless_deep.py", "tests/test_tree.py"]
IGNORED = shutil.ignore_patterns(".venv", "venv", "outputs", "multirun", ".git", "__pycache__", ".pytest_cache",
                                 "*.egg-info")


@dataclass(frozen=True)
class Mutant:
    name: str  # the double it re-creates (tests/broken_doubles.py)
    path: str  # the module edited
    edits: tuple[tuple[str, str], ...]  # (original line, mutated line), each original occurring once
    what: str


MUTANTS = [
    Mutant("warp_order", "cascade/verify.py", ((
        "        p = logits_to_probs(logits, sampling)  # [n + 1, V]",
        "        p = logits_to_probs(torch.log(logits_to_probs(logits, SamplingConfig(1.0, sampling.top_k, sampling.top_p)))"
        " / sampling.temperature, SamplingConfig(1.0))  # [n + 1, V]"),),
        "the target's p: temperature applied after top-k / top-p"),
    Mutant("unwarped_draw", "cascade/verify.py", ((
        "        p = logits_to_probs(logits, sampling)  # [n + 1, V]",
        "        p = torch.softmax(logits.double(), -1)  # [n + 1, V]"),),
        "the target's p unwarped (ratios, recovered and bonus tokens): the one-line form of the double"),
    Mutant("untruncated_q", "cascade/drafters/lm_base.py", ((
        "                qs.append(q)",
        "                qs.append(logits_to_probs(logits, type(self.sampling)(self.sampling.temperature)))"),),
        "an LM drafter samples from the truncated q, reports q before top-k / top-p"),
    Mutant("stale_sibling", "cascade/verify.py", ((
        "            residual = residual_distribution(residual, q_row)",
        "            residual = residual if q is not None and len(kids[j]) > 1 and _uniform(generator) < 0.25"
        " else residual_distribution(residual, q_row)"),),
        "recursive rejection: the residual not updated after a sampled sibling's rejection, 25% of the time"),
    Mutant("shared_uniform", "cascade/verify.py", (
        ("        residual = p[j]  # [V]\n        nxt = None", "        residual = p[j]  # [V]\n        nxt, u = None, None"),
        ("            if qx > 0 and _uniform(generator) * qx < float(residual[x]):",
         "            if qx > 0 and (u := u or _uniform(generator)) * qx < float(residual[x]):")),
        "recursive rejection: one uniform for all children of a node (two lines)"),
    Mutant("no_replacement", "cascade/trees/static.py", ((
        "calls.draw(q), q,",
        "calls.draw(q.index_fill(0, torch.tensor([n.token for n in tree.nodes if n.parent == node], dtype=torch.long),"
        " 0.0)), q,"),),
        "a static tree's sampled siblings drawn without replacement, each reporting the full q"),
    Mutant("bonus_from_q", "cascade/verify.py", ((
        "            return VerifyResult(len(path), int(sample(residual, generator)), not kids[j], path, judgements)",
        "            return VerifyResult(len(path), int(sample(q[path[-1]].to(residual.dtype) if not kids[j] and path"
        " and q is not None else residual, generator)), not kids[j], path, judgements)"),),
        "the bonus token below a leaf drawn from the leaf's q row"),
    Mutant("commit_off_by_one", "cascade/verify.py", ((
        "    return [0] + [i + 1 for i in result.path]",
        "    return list(range(len(result.path) + 1))"),),
        "the cache keeps inputs 0 .. len(path) after any path (a chain's crop), not the path's inputs"),
    Mutant("block_weight_shift", "cascade/verify.py", ((
        "            stop, law = _after_rejection(weights[j], p[j], _q_row(q, j, tokens[j], p[j]))",
        "            stop, law = _after_rejection(weights[j + (j > 0)], p[j], _q_row(q, j, tokens[j], p[j]))"),),
        "block verification's backward pass reads w_{j+1} for w_j (0 < j < k)"),
    Mutant("traversal_stale", "cascade/verify.py", ((
        "            weight, law = _after_rejection(weight, law, _q_row(q, c, tokens[c], law))  # c's subtree rejected",
        "            weight, law = weight, _after_rejection(weight, law, _q_row(q, c, tokens[c], law))[1]"),),
        "traversal verification keeps a parent's weight after a child's subtree is rejected"),
]


def make_copy(mutant: Mutant, into: Path) -> Path:
    """The working tree copied under ``into`` with the mutant's edits applied."""
    tree = into / "tree"
    shutil.copytree(ROOT, tree, ignore=IGNORED)
    module = tree / mutant.path
    text = module.read_text()
    for old, new in mutant.edits:
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"{mutant.name}: the original line occurs {count} times in {mutant.path}: {old!r}")
        text = text.replace(old, new)
    module.write_text(text)
    return tree


def run_pytest(tree: Path, files: list[str], env: dict) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-n", "2", "-p", "no:cacheprovider", *files]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    return out.returncode, out.stdout + out.stderr


def first_failure(output: str) -> str | None:
    """The first test pytest's summary lists as failed, if any."""
    m = re.search(r"^FAILED (\S+)", output, re.M)
    return m.group(1) if m else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="mutant names (default: all)")
    ap.add_argument("--log", type=Path, help="append the table to this file")
    ap.add_argument("--targeted-only", action="store_true",
                    help="do not run the whole default suite on a mutant the losslessness files miss")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.only and len(chosen) != len(args.only):
        raise SystemExit(f"unknown mutants; known: {[m.name for m in MUTANTS]}")
    rows = []
    for mutant in chosen:
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as scratch:
            tree = make_copy(mutant, Path(scratch))
            env = {**os.environ, "PYTHONPATH": str(tree)}
            where = subprocess.run([sys.executable, "-c", "import cascade; print(cascade.__file__)"], cwd=tree, env=env,
                                   capture_output=True, text=True).stdout.strip()
            if not where.startswith(str(tree)):
                raise SystemExit(f"the copy's cascade is not the one imported ({where}): install the project editable "
                                 "or not at all, and run from the repository")
            rc, output = run_pytest(tree, TARGETED, env)
            scope = "losslessness files"
            if rc == 0 and not args.targeted_only:
                rc, output = run_pytest(tree, ["tests"], env)
                scope = "whole default suite"
        # -x under pytest-xdist ends the session as interrupted (rc 2) after the first failure
        failing = first_failure(output) if rc in (1, 2) else None
        if failing:
            verdict = "caught"
        elif rc == 0:
            verdict, failing = ("not caught by the losslessness files" if args.targeted_only else "survived"), ""
        else:
            verdict, failing = f"error (pytest rc {rc})", output.strip().splitlines()[-1]
        rows.append((mutant, verdict, scope, failing, (time.time() - t0) / 60))
        print(f"{mutant.name:20s} {verdict:9s} ({scope}; {rows[-1][4]:.1f} min) {failing}", flush=True)
    table = ["| mutant | the edit | result | run | first failing test | minutes |", "| --- | --- | --- | --- | --- | --- |"]
    table += [f"| {m.name} | {m.what} | {v} | {s} | `{f}` | {t:.1f} |" for m, v, s, f, t in rows]
    print("\n".join(table))
    if args.log:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        with args.log.open("a") as fh:
            fh.write(f"\n# {time.strftime('%Y-%m-%d %H:%M')} git {_commit()}\n" + "\n".join(table) + "\n")
    sys.exit(0 if all(v == "caught" for _, v, *_ in rows) else 1)


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
