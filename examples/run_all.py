"""Runs every seed example's ``main()`` in one process; exits non-zero if any fails.

Usage: ``python examples/run_all.py`` (or ``python -m examples.run_all``).
"""

from __future__ import annotations

import os

# shard_map_add wants 8 CPU devices; the count is fixed when jax is first imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import importlib
import pathlib
import sys
import time
import traceback

EXAMPLES = (
    "vector_add",
    "iota",
    "matmul_2x2",
    "blocked_add_uneven",
    "matmul_activation",
    "matmul_3d_grid",
    "softmax",
    "row_reduction",
    "flash_attention",
    "vmap_attention",
    "shard_map_add",
)


def main() -> int:
    """Runs each example, prints one summary line per example and returns the exit status."""
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    results = []
    for name in EXAMPLES:
        start = time.perf_counter()
        try:
            importlib.import_module(f"examples.{name}").main()
        except Exception:
            traceback.print_exc()
            ok = False
        else:
            ok = True
        results.append((name, ok, time.perf_counter() - start))
    print()
    for name, ok, seconds in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name:<20} {seconds:6.2f}s")
    failed = [name for name, ok, _ in results if not ok]
    print(f"{len(results) - len(failed)}/{len(results)} examples passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
