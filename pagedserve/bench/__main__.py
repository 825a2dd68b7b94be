"""``python -m pagedserve.bench``: the same as ``pagedserve bench``."""

from __future__ import annotations

import sys

from pagedserve.bench.cli import build_parser, main

if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
