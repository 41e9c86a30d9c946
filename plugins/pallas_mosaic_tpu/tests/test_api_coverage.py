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

from pallas_core.testing.api_pages import ApiPage, ApiPageTests

pltpu = pytest.importorskip("pallas_mosaic_tpu")

PAGE = ApiPage(Path(__file__).resolve().parents[3] / "docs" / "backends" / "mosaic_tpu_api.md",
               jax_pltpu, pltpu)


class TestPage(ApiPageTests):
    page = PAGE
