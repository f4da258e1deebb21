"""Regenerate the Markdown table and PNG plot from a benchmark JSON.

    .venv/bin/python benchmarks/report.py benchmarks/results/2026-11-30-myhost.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from vllm_usd.bench import write_outputs

    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(args[0])
    paths = write_outputs(json.loads(path.read_text()), path)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
