"""Checks that keep a backend's API page true: a table listing every public name of one
``jax.experimental.pallas`` module with its status in the backend's package.

A page's table has rows ``| `name` | status | notes |``; status is one of :data:`STATUSES`.
Notes opening with a version mark ("New in 0.11", "Removed in 0.11", "Deprecated in 0.10")
say that only some JAX versions list the name. ``core`` rows name their replacement
(``pl.<attr>``) in the notes. Each backend's coverage test builds an :class:`ApiPage` and runs
its checks, one test each, by subclassing :class:`ApiPageTests`:

* :meth:`ApiPage.check_rows` — rows well formed, no name twice, non-supported rows explained;
* :meth:`ApiPage.check_every_jax_name_listed` — upgrading JAX fails until the page covers the
  new names;
* :meth:`ApiPage.check_version_marks` — a mark agrees with the installed JAX, and a row without
  one names something this JAX lists;
* :meth:`ApiPage.check_supported_rows_exist` and :meth:`ApiPage.check_exports_marked_supported`
  — ``supported`` means exported, and implementing something fails until the page says so;
* :meth:`ApiPage.check_core_rows` — ``core`` rows name an attribute ``pallas_core`` has.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from types import ModuleType

import jax

import pallas_core as pl

STATUSES = ("supported", "core", "not yet", "refused", "not applicable")
JAX_VERSION = tuple(int(re.match(r"\d+", p).group()) for p in  # type: ignore[union-attr]
                    jax.__version__.split(".")[:2])
VERSION_MARK = re.compile(r"(New|Removed|Deprecated) in (\d+)\.(\d+)")
PL_NAME = re.compile(r"(?<![\w.])pl\.([A-Za-z_]\w*)")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    status: str
    notes: str
    line: int


@dataclasses.dataclass(frozen=True)
class ApiPage:
    """The page at ``path`` for JAX's module ``jax_module`` and our package ``ours``."""

    path: Path
    jax_module: ModuleType
    ours: ModuleType

    @property
    def jax_name(self) -> str:
        return self.jax_module.__name__

    @property
    def ours_name(self) -> str:
        return self.ours.__name__

    @functools.cached_property
    def jax_names(self) -> frozenset[str]:
        """Public names of the JAX module; its submodules (``jax.experimental.pallas.tpu``),
        which appear once imported, are pages of their own."""
        def submodule(n: str) -> bool:
            value = getattr(self.jax_module, n, None)
            return isinstance(value, ModuleType) and value.__name__ == f"{self.jax_name}.{n}"

        return frozenset(n for n in dir(self.jax_module)
                         if not n.startswith("_") and not submodule(n))

    @functools.cached_property
    def rows(self) -> list[Row]:
        """The rows of the page's table (header and separator skipped)."""
        rows = []
        for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.startswith("|"):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] == "Name" or set(cells[0]) <= set("-: "):
                continue
            assert len(cells) == 3, (
                f"{self.path.name}:{number}: expected 3 cells (name, status, notes), found "
                f"{len(cells)}. Fix: write `| `name` | status | notes |`, with no '|' inside "
                "the notes.")
            rows.append(Row(cells[0].strip("`"), cells[1], cells[2], number))
        return rows

    @functools.cached_property
    def by_name(self) -> dict[str, Row]:
        return {r.name: r for r in self.rows}

    def where(self, row: Row) -> str:
        return f"{self.path.name}:{row.line} ({row.name})"

    def check_rows(self) -> None:
        assert self.rows, f"no table rows found in {self.path}"
        seen: set[str] = set()
        for row in self.rows:
            assert row.status in STATUSES, (
                f"{self.where(row)}: status {row.status!r} is not one of {STATUSES}.")
            assert row.name not in seen, f"{self.where(row)}: {row.name} has two rows."
            seen.add(row.name)
            if row.status != "supported":
                assert row.notes, f"{self.where(row)}: a {row.status!r} row needs notes."

    def check_every_jax_name_listed(self) -> None:
        missing = sorted(self.jax_names - self.by_name.keys())
        assert not missing, (
            f"{self.jax_name} {jax.__version__} has names that {self.path.name} does not list: "
            f"{missing}. Fix: add a row for each (opening its notes with 'New in "
            f"{JAX_VERSION[0]}.{JAX_VERSION[1]}.' if the older JAX lacks it).")

    def check_version_marks(self) -> None:
        for row in self.rows:
            mark = VERSION_MARK.match(row.notes)
            if mark is None:
                listed = True
            else:
                kind, version = mark.group(1), (int(mark.group(2)), int(mark.group(3)))
                listed = version <= JAX_VERSION if kind == "New" else version > JAX_VERSION
            assert (row.name in self.jax_names) == listed, (
                f"{self.where(row)}: the notes say "
                f"{mark.group(0) if mark else 'nothing of versions'}, so JAX {jax.__version__} "
                f"should {'' if listed else 'not '}list {row.name} in dir({self.jax_name}), but "
                f"it does{' not' if listed else ''}. Fix: correct the name or open the notes "
                "with its version mark.")

    def check_supported_rows_exist(self) -> None:
        absent = [self.where(r) for r in self.rows
                  if r.status == "supported" and not hasattr(self.ours, r.name)]
        assert not absent, (
            f"rows marked supported but missing from {self.ours_name}: {absent}. Fix: mark "
            f"them 'not yet', or export them from {self.ours_name}.")

    def check_exports_marked_supported(self) -> None:
        exported = set(self.ours.__all__) & (self.jax_names | self.by_name.keys())
        unmarked = sorted(n for n in exported
                          if n not in self.by_name or self.by_name[n].status != "supported")
        assert not unmarked, (
            f"{self.ours_name} exports {unmarked}, names of {self.jax_name}, but "
            f"{self.path.name} does not mark them supported. Fix: mark them 'supported' and "
            "note any difference from JAX's.")

    def check_core_rows(self) -> None:
        for row in self.rows:
            if row.status != "core":
                continue
            found = PL_NAME.search(row.notes)
            assert found, f"{self.where(row)}: a core row must name its `pl.<attr>` in the notes."
            assert hasattr(pl, found.group(1)), (
                f"{self.where(row)}: pallas_core has no attribute {found.group(1)!r}. Fix: name "
                "the core's replacement, or change the status.")


class ApiPageTests:
    """Every check of :class:`ApiPage` as a pytest test: subclass it as ``Test...`` and set
    ``page``."""

    page: ApiPage

    def test_rows_are_well_formed(self) -> None:
        self.page.check_rows()

    def test_every_jax_name_is_listed(self) -> None:
        self.page.check_every_jax_name_listed()

    def test_version_marks_match_installed_jax(self) -> None:
        self.page.check_version_marks()

    def test_supported_rows_exist(self) -> None:
        self.page.check_supported_rows_exist()

    def test_jax_names_we_export_are_marked_supported(self) -> None:
        self.page.check_exports_marked_supported()

    def test_core_rows_name_an_existing_pl_attribute(self) -> None:
        self.page.check_core_rows()
