"""``docs/backends/sparsecore_api.md`` lists every public name of
``jax.experimental.pallas.tpu_sc`` with its status here; these tests keep the page true to the
installed JAX, ``plsc`` and ``pl``: every JAX name has a row (with a version mark, "New in 0.11"
..., only where one JAX lacks it), ``supported`` rows exist as ``plsc.<name>``, every JAX name
``plsc`` exports is marked ``supported``, ``core`` rows name a ``pl.<attr>`` that exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest

import pallas_core as pl

plsc = pytest.importorskip("pallas_sparsecore")
jax_plsc = pytest.importorskip("jax.experimental.pallas.tpu_sc")

PAGE = Path(__file__).resolve().parents[3] / "docs" / "backends" / "sparsecore_api.md"
STATUSES = ("supported", "core", "not yet", "not applicable")
JAX_NAMES = frozenset(n for n in dir(jax_plsc) if not n.startswith("_"))
JAX_VERSION = tuple(int(re.match(r"\d+", p).group()) for p in jax.__version__.split(".")[:2])
VERSION_MARK = re.compile(r"(New|Removed|Deprecated) in (\d+)\.(\d+)")
PL_NAME = re.compile(r"(?<![\w.])pl\.([A-Za-z_]\w*)")


def _rows() -> dict[str, tuple[str, str, int]]:
    """``{name: (status, notes, line)}`` for the page's table rows."""
    rows: dict[str, tuple[str, str, int]] = {}
    for number, line in enumerate(PAGE.read_text(encoding="utf-8").splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] == "Name" or set(cells[0]) <= set("-: "):
            continue
        where = f"{PAGE.name}:{number}"
        assert len(cells) == 3, f"{where}: expected `| `name` | status | notes |`, no '|' in notes."
        name, status, notes = cells[0].strip("`"), cells[1], cells[2]
        assert status in STATUSES, f"{where}: status {status!r} is not one of {STATUSES}."
        assert name not in rows, f"{where}: {name} has two rows."
        assert notes or status == "supported", f"{where}: a {status!r} row needs notes."
        rows[name] = (status, notes, number)
    assert rows, f"no table rows found in {PAGE}"
    return rows


ROWS = _rows()


def test_every_jax_name_is_listed_with_the_right_version_mark() -> None:
    missing = sorted(JAX_NAMES - ROWS.keys())
    assert not missing, (
        f"jax.experimental.pallas.tpu_sc {jax.__version__} has names {PAGE.name} does not list: "
        f"{missing}. Fix: add a row for each (notes opening 'New in {JAX_VERSION[0]}."
        f"{JAX_VERSION[1]}.' if the other JAX lacks it).")
    for name, (_, notes, line) in ROWS.items():
        mark = VERSION_MARK.match(notes)
        listed = mark is None or (
            (int(mark[2]), int(mark[3])) <= JAX_VERSION if mark[1] == "New"
            else (int(mark[2]), int(mark[3])) > JAX_VERSION)
        assert (name in JAX_NAMES) == listed, (
            f"{PAGE.name}:{line}: JAX {jax.__version__} should {'' if listed else 'not '}list "
            f"{name} in tpu_sc (notes: {mark[0] if mark else 'no version mark'}). Fix: correct "
            "the name or its version mark.")


def test_supported_rows_match_plsc() -> None:
    absent = [n for n, (s, _, _) in ROWS.items() if s == "supported" and not hasattr(plsc, n)]
    assert not absent, f"rows marked supported but missing from plsc: {absent}. Fix: mark " \
        "them 'not yet', or export them from pallas_sparsecore."
    exported = set(plsc.__all__) & (JAX_NAMES | ROWS.keys())
    unmarked = sorted(n for n in exported if ROWS.get(n, ("",))[0] != "supported")
    assert not unmarked, f"plsc exports {unmarked}, names of JAX's tpu_sc, but {PAGE.name} " \
        "does not mark them supported. Fix: mark them 'supported', noting differences."


def test_core_rows_name_an_existing_pl_attribute() -> None:
    for name, (status, notes, line) in ROWS.items():
        found = PL_NAME.search(notes) if status == "core" else None
        assert status != "core" or (found and hasattr(pl, found[1])), (
            f"{PAGE.name}:{line} ({name}): a core row must name an existing `pl.<attr>`.")
