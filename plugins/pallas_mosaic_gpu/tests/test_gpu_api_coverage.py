"""``docs/backends/mosaic_gpu_api.md`` lists every public name of
``jax.experimental.pallas.mosaic_gpu`` with its status here; these tests keep the page true to the
installed JAX, ``plgpu`` and ``pl``.

* every public name of the installed ``jax.experimental.pallas.mosaic_gpu`` has a row (upgrading
  JAX fails here until the page covers the new names);
* a row's version mark ("New in 0.11", "Removed in 0.11", "Deprecated in 0.11" opening its notes)
  agrees with the installed JAX, and a row without one names something this JAX lists;
* ``supported`` rows exist as ``plgpu.<name>``, and every JAX name ``plgpu`` exports is marked
  ``supported`` (implementing something fails here until the page says so);
* ``core`` rows name (first ``pl.<attr>`` in their notes) an attribute ``pl`` has;
* the page's section on older spellings stays true: ``Barrier(num_threads=...)`` is
  ``Barrier(num_arrivals=...)``, and ``pl.load`` takes no ``memory_space``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import jax
import pytest

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
# JAX's Mosaic GPU modules import absl, which jax itself does not require.
jax_plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

PAGE = Path(__file__).resolve().parents[3] / "docs" / "backends" / "mosaic_gpu_api.md"
STATUSES = ("supported", "core", "not yet", "not applicable")
JAX_NAMES = frozenset(n for n in dir(jax_plgpu) if not n.startswith("_"))
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
        f"jax.experimental.pallas.mosaic_gpu {jax.__version__} has names that {PAGE.name} does "
        f"not list: {missing}. Fix: add a row for each (opening its notes with 'New in "
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
            f"dir(jax.experimental.pallas.mosaic_gpu), but it does{' not' if listed else ''}. "
            "Fix: correct the name or open the notes with its version mark.")


def test_supported_rows_exist_in_plgpu() -> None:
    absent = [_where(r) for r in ROWS if r.status == "supported" and not hasattr(plgpu, r.name)]
    assert not absent, (
        f"rows marked supported but missing from pallas_mosaic_gpu: {absent}. Fix: mark them "
        "'not yet', or export them from pallas_mosaic_gpu.")


def test_jax_names_plgpu_exports_are_marked_supported() -> None:
    exported = set(plgpu.__all__) & (JAX_NAMES | BY_NAME.keys())
    unmarked = sorted(n for n in exported
                      if n not in BY_NAME or BY_NAME[n].status != "supported")
    assert not unmarked, (
        f"pallas_mosaic_gpu exports {unmarked}, names of jax.experimental.pallas.mosaic_gpu, "
        f"but {PAGE.name} does not mark them supported. Fix: mark them 'supported' and note any "
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


def test_older_spellings_section_holds() -> None:
    assert plgpu.Barrier(num_threads=3) == plgpu.Barrier(num_arrivals=3), (
        f"plgpu.Barrier(num_threads=3) is no longer plgpu.Barrier(num_arrivals=3), as {PAGE.name}"
        " says. Fix: restore the older spelling, or rewrite that section.")
    params = inspect.signature(pl.load).parameters
    assert "memory_space" not in params, (
        f"pl.load now takes memory_space=, but {PAGE.name} says passing it raises a TypeError. "
        "Fix: rewrite the section on older spellings.")
    with pytest.raises(TypeError, match="memory_space"):
        pl.load(None, ..., memory_space=plgpu.SMEM)
