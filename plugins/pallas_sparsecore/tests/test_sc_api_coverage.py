"""``docs/backends/sparsecore_api.md`` lists every public name of
``jax.experimental.pallas.tpu_sc`` with its status here; these tests keep the page true to the
installed JAX, ``plsc`` and ``pl``: every JAX name has a row (with a version mark, "New in 0.11"
..., only where one JAX lacks it), ``supported`` rows exist as ``plsc.<name>``, every JAX name
``plsc`` exports is marked ``supported``, ``core`` rows name a ``pl.<attr>`` that exists. The
checks are ``pallas_core.testing.api_pages``'s, shared with the other backends' pages.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pallas_core.testing.api_pages import ApiPage

plsc = pytest.importorskip("pallas_sparsecore")
jax_plsc = pytest.importorskip("jax.experimental.pallas.tpu_sc")

PAGE = ApiPage(Path(__file__).resolve().parents[3] / "docs" / "backends" / "sparsecore_api.md",
               jax_plsc, plsc)


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
