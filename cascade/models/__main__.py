"""`python -m cascade.models {list,fetch NAME,verify NAME}`."""

from __future__ import annotations

import argparse
import logging
import sys

from cascade.models import zoo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cascade.models", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list zoo models and whether they are cached")
    fetch = sub.add_parser("fetch", help="download, verify and convert a zoo model")
    fetch.add_argument("name", choices=sorted(zoo.ZOO))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "list":
        print(f"cache: {zoo.cache_root()}  (override with CASCADE_CACHE)")
        for name, entry in sorted(zoo.ZOO.items()):
            cached = (zoo.cache_root() / "models" / name / "bf16" / "config.json").is_file()
            print(f"  {name:22s} {'cached ' if cached else 'missing'}  {entry.description}")
        return 0
    try:
        path = zoo.fetch(args.name)
    except zoo.ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{args.name}: ready at {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
