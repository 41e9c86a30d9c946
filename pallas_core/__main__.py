"""``python -m pallas_core``: the installed backends, their versions and platforms."""

from __future__ import annotations

import sys

import jax

from pallas_core import __version__
from pallas_core.plugins import manager


def main() -> int:
    """Prints the installed backends and any that failed to load."""
    print(f"pallas-core {__version__} (jax {jax.__version__}, default platform "
          f"{jax.default_backend()})")
    backends = manager.backends()
    skipped = manager.skipped()
    if not backends and not skipped:
        print("no backends installed. Fix: pip install pallas-interpret")
    for name, b in sorted(backends.items()):
        info = b.info
        default = f", default on {', '.join(info.default_for)}" if info.default_for else ""
        caps = ""
        if info.capabilities:
            caps = f"\n    capabilities: {', '.join(sorted(info.capabilities))}"
        print(f"  {name:<12} {info.version:<10} {info.package or '?':<20} platforms: "
              f"{', '.join(info.platforms)}{default}{caps}")
    for name, reason in sorted(skipped.items()):
        print(f"  {name:<12} not loaded: {reason} is set")
    errors = manager.errors()
    for name, err in sorted(errors.items()):
        print(f"  {name:<12} FAILED TO LOAD: {err}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
