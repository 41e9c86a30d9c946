"""No source file of the packages is longer than 800 lines (STYLE.md: a file is read whole;
JAX's longest Pallas modules are what a newcomer meets at twice that). Tests are left out:
a test module is a list of cases, read case by case.

The packages: the core (``pallas_core``), every first-party plugin package
(``plugins/*/pallas_*``) and the test backend (``tests/third_party_backend``).
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT = 800


def package_sources() -> list[pathlib.Path]:
    roots = [ROOT / "pallas_core", *sorted(ROOT.glob("plugins/*/pallas_*")),
             ROOT / "tests/third_party_backend"]
    return [p for r in roots for p in sorted(r.rglob("*.py"))
            if "tests" not in p.relative_to(r).parts]


def test_no_package_source_file_is_over_the_limit() -> None:
    sources = package_sources()
    assert len(sources) > 150, len(sources)  # the walk found the packages
    long = {str(p.relative_to(ROOT)): n for p in sources
            if (n := len(p.read_text().splitlines())) > LIMIT}
    assert not long, (
        f"source files over {LIMIT} lines (split them along a seam, as "
        f"docs/architecture.md's module tables show): {long}")
