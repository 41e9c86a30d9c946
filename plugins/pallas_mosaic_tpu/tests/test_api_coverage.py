"""``docs/backends/mosaic_tpu_api.md`` lists every public name of ``jax.experimental.pallas.tpu``
with its status here; these tests keep the page true to the installed JAX, ``pltpu`` and ``pl``.

* every public name of the installed ``jax.experimental.pallas.tpu`` has a row (upgrading JAX
  fails here until the page covers the new names);
* a row's version mark ("New in 0.11", "Removed in 0.11", "Deprecated in 0.10" opening its notes)
  agrees with the installed JAX, and a row without one names something this JAX lists;
* ``supported`` rows exist as ``pltpu.<name>``, and every JAX name ``pltpu`` exports is marked
  ``supported`` (implementing something fails here until the page says so);
* ``core`` rows name (first ``pl.<attr>`` in their notes) an attribute ``pl`` has.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import pytest
from jax.experimental.pallas import tpu as jax_pltpu

import pallas_core as pl

pltpu = pytest.importorskip("pallas_mosaic_tpu")

PAGE = Path(__file__).resolve().parents[3] / "docs" / "backends" / "mosaic_tpu_api.md"
STATUSES = ("supported", "core", "not yet", "not applicable")
JAX_NAMES = frozenset(n for n in dir(jax_pltpu) if not n.startswith("_"))
JAX_VERSION = tuple(int(re.match(r"\d+", p).group()) for p in jax.__version__.split(".")[:2])
VERSION_MARK = re.compile(r"(New|Removed|Deprecated) in (\d+)\.(\d+)")
PL_NAME = re.compile(r"(?<![\w.])pl\.([A-Za-z_]\w*)")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    status: str
    notes: str
    line: int


def _rows() -> list[Row]:
    """The rows of the page's table (header and separator skipped)."""
    rows = []
    for number, line in enumerate(PAGE.read_text(encoding="utf-8").splitlines(), 1):
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "Name" or set(cells[0]) <= set("-: "):
            continue
        assert len(cells) == 3, (
            f"{PAGE.name}:{number}: expected 3 cells (name, status, notes), found {len(cells)}. "
            "Fix: write `| `name` | status | notes |`, with no '|' inside the notes.")
        rows.append(Row(cells[0].strip("`"), cells[1], cells[2], number))
    return rows


ROWS = _rows()
BY_NAME = {r.name: r for r in ROWS}


def _where(row: Row) -> str:
    return f"{PAGE.name}:{row.line} ({row.name})"


def test_rows_are_well_formed() -> None:
    assert ROWS, f"no table rows found in {PAGE}"
    seen: set[str] = set()
    for row in ROWS:
        assert row.status in STATUSES, (
            f"{_where(row)}: status {row.status!r} is not one of {STATUSES}.")
        assert row.name not in seen, f"{_where(row)}: {row.name} has two rows."
        seen.add(row.name)
        if row.status != "supported":
            assert row.notes, f"{_where(row)}: a {row.status!r} row needs notes."


def test_every_jax_name_is_listed() -> None:
    missing = sorted(JAX_NAMES - BY_NAME.keys())
    assert not missing, (
        f"jax.experimental.pallas.tpu {jax.__version__} has names that {PAGE.name} does not "
        f"list: {missing}. Fix: add a row for each (opening its notes with 'New in "
        f"{JAX_VERSION[0]}.{JAX_VERSION[1]}.' if the older JAX lacks it).")


def test_version_marks_match_installed_jax() -> None:
    for row in ROWS:
        mark = VERSION_MARK.match(row.notes)
        if mark is None:
            listed = True
        else:
            kind, version = mark.group(1), (int(mark.group(2)), int(mark.group(3)))
            listed = version <= JAX_VERSION if kind == "New" else version > JAX_VERSION
        assert (row.name in JAX_NAMES) == listed, (
            f"{_where(row)}: the notes say {mark.group(0) if mark else 'nothing of versions'}, "
            f"so JAX {jax.__version__} should {'' if listed else 'not '}list {row.name} in "
            f"dir(jax.experimental.pallas.tpu), but it does{' not' if listed else ''}. Fix: "
            "correct the name or open the notes with its version mark.")


def test_supported_rows_exist_in_pltpu() -> None:
    absent = [_where(r) for r in ROWS if r.status == "supported" and not hasattr(pltpu, r.name)]
    assert not absent, (
        f"rows marked supported but missing from pallas_mosaic_tpu: {absent}. Fix: mark them "
        "'not yet', or export them from pallas_mosaic_tpu.")


def test_jax_names_pltpu_exports_are_marked_supported() -> None:
    exported = set(pltpu.__all__) & (JAX_NAMES | BY_NAME.keys())
    unmarked = sorted(n for n in exported
                      if n not in BY_NAME or BY_NAME[n].status != "supported")
    assert not unmarked, (
        f"pallas_mosaic_tpu exports {unmarked}, names of jax.experimental.pallas.tpu, but "
        f"{PAGE.name} does not mark them supported. Fix: mark them 'supported' and note any "
        "difference from JAX's.")


def test_core_rows_name_an_existing_pl_attribute() -> None:
    for row in ROWS:
        if row.status != "core":
            continue
        found = PL_NAME.search(row.notes)
        assert found, f"{_where(row)}: a core row must name its `pl.<attr>` in the notes."
        assert hasattr(pl, found.group(1)), (
            f"{_where(row)}: pallas_core has no attribute {found.group(1)!r}. Fix: name the "
            "core's replacement, or change the status.")
