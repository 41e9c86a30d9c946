"""Runs the ``python`` code blocks of Markdown files, each file's blocks in one namespace.

``python run_md_examples.py README.md ...`` exits non-zero at the first block that fails. The
per-plugin READMEs' examples (each lowers or runs a kernel for its backend) are checked this way
by the ``wheels`` tox environment, against the installed wheels.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def run(path: Path) -> int:
    """Executes the python blocks of ``path`` in order; returns how many ran."""
    blocks = _BLOCK.findall(path.read_text())
    namespace: dict[str, object] = {"__name__": "__md_example__"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{path}[block {i}]", "exec"), namespace)
    return len(blocks)


def main(argv: list[str]) -> int:
    for name in argv:
        start = time.perf_counter()
        count = run(Path(name))
        if not count:
            print(f"{name}: no python blocks", file=sys.stderr)
            return 1
        print(f"{name}: {count} python block(s) ran ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
