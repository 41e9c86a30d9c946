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

from pallas_core.testing.api_pages import ApiPage, ApiPageTests

plsc = pytest.importorskip("pallas_sparsecore")
jax_plsc = pytest.importorskip("jax.experimental.pallas.tpu_sc")

PAGE = ApiPage(Path(__file__).resolve().parents[3] / "docs" / "backends" / "sparsecore_api.md",
               jax_plsc, plsc)


class TestPage(ApiPageTests):
    page = PAGE
