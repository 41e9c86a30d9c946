"""``docs/backends/mosaic_tpu_api.md`` lists every public name of ``jax.experimental.pallas.tpu``
with its status here; these tests keep the page true to the installed JAX, ``pltpu`` and ``pl``.

* every public name of the installed ``jax.experimental.pallas.tpu`` has a row (upgrading JAX
  fails here until the page covers the new names);
* a row's version mark ("New in 0.11", "Removed in 0.11", "Deprecated in 0.10" opening its notes)
  agrees with the installed JAX, and a row without one names something this JAX lists;
* ``supported`` rows exist as ``pltpu.<name>``, and every JAX name ``pltpu`` exports is marked
  ``supported`` (implementing something fails here until the page says so);
* ``core`` rows name (first ``pl.<attr>`` in their notes) an attribute ``pl`` has.

The checks are ``pallas_core.testing.api_pages``'s, shared with the other backends' pages.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jax.experimental.pallas import tpu as jax_pltpu

from pallas_core.testing.api_pages import ApiPage

pltpu = pytest.importorskip("pallas_mosaic_tpu")

PAGE = ApiPage(Path(__file__).resolve().parents[3] / "docs" / "backends" / "mosaic_tpu_api.md",
               jax_pltpu, pltpu)


def test_rows_are_well_formed() -> None:
    PAGE.check_rows()


def test_every_jax_name_is_listed() -> None:
    PAGE.check_every_jax_name_listed()


def test_version_marks_match_installed_jax() -> None:
    PAGE.check_version_marks()


def test_supported_rows_exist() -> None:
    PAGE.check_supported_rows_exist()


def test_jax_names_we_export_are_marked_supported() -> None:
    PAGE.check_exports_marked_supported()


def test_core_rows_name_an_existing_pl_attribute() -> None:
    PAGE.check_core_rows()
