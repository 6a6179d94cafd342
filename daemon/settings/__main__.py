"""`python3 -m cpud.settings --markdown` prints README's configuration reference as the
settings table renders it; `--readme README.md` writes it between the file's markers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from cpud.settings.reference import render_markdown, replace_section


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m cpud.settings", description=__doc__)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--markdown", action="store_true", help="print the reference")
    what.add_argument("--readme", type=Path, metavar="PATH", help="rewrite PATH's reference")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(render_markdown())
        return 0
    try:
        text = replace_section(args.readme.read_text())
    except (OSError, ValueError) as exc:
        print(f"cpud.settings: {args.readme}: {exc}", file=sys.stderr)
        return 2
    args.readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
