"""What the diagnostic scripts in benchmarks/ share: print a result as JSON and save it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], out: str | None) -> int:
    """Print ``result`` as JSON, write it to ``out`` if given; the script's exit code (0)."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text)
    return 0
