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
* every name not ``supported`` (``refused``, ``core``, ``not applicable``) exists as
  ``plgpu.<name>`` and raises ``pl.UnsupportedError`` naming it when called or when an
  attribute of it is read (``pallas_mosaic_gpu.refused``); no row is ``not yet``;
* the page's section on older spellings stays true: ``Barrier(num_threads=...)`` is
  ``Barrier(num_arrivals=...)``, and ``pl.load`` takes no ``memory_space``.

The table checks are ``pallas_core.testing.api_pages``'s, shared with the other backends' pages.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import pallas_core as pl
from pallas_core.testing.api_pages import ApiPage, ApiPageTests

plgpu = pytest.importorskip("pallas_mosaic_gpu")
# JAX's Mosaic GPU modules import absl, which jax itself does not require.
jax_plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

PAGE = ApiPage(Path(__file__).resolve().parents[3] / "docs" / "backends" / "mosaic_gpu_api.md",
               jax_plgpu, plgpu)


class TestPage(ApiPageTests):
    page = PAGE


def test_older_spellings_section_holds() -> None:
    assert plgpu.Barrier(num_threads=3) == plgpu.Barrier(num_arrivals=3), (
        f"plgpu.Barrier(num_threads=3) is no longer plgpu.Barrier(num_arrivals=3), as "
        f"{PAGE.path.name} says. Fix: restore the older spelling, or rewrite that section.")
    params = inspect.signature(pl.load).parameters
    assert "memory_space" not in params, (
        f"pl.load now takes memory_space=, but {PAGE.path.name} says passing it raises a "
        "TypeError. Fix: rewrite the section on older spellings.")
    with pytest.raises(TypeError, match="memory_space"):
        pl.load(None, ..., memory_space=plgpu.SMEM)


NOT_SUPPORTED = sorted(r.name for r in PAGE.rows if r.status != "supported")


def test_every_name_is_supported_or_refused() -> None:
    undecided = [PAGE.where(r) for r in PAGE.rows if r.status == "not yet"]
    assert not undecided, (
        f"rows still 'not yet': {undecided}. Fix: implement them (status 'supported') or refuse "
        "them in pallas_mosaic_gpu/refused.py (status 'refused').")


@pytest.mark.parametrize("name", NOT_SUPPORTED)
def test_unsupported_name_raises_naming_itself(name: str) -> None:
    obj = getattr(plgpu, name)
    named = rf"plgpu\.{name}\b.*Fix: "
    with pytest.raises(pl.UnsupportedError, match=named):
        obj(1, key=2)
    with pytest.raises(pl.UnsupportedError, match=named):
        obj.Member  # noqa: B018 - an enum member or class attribute of JAX's
    assert name not in plgpu.__all__


def test_refusal_table_matches_the_page() -> None:
    from pallas_mosaic_gpu import refused
    rows = PAGE.by_name
    stale = sorted(n for n in refused.REFUSED if n not in rows or rows[n].status == "supported")
    assert not stale, (
        f"pallas_mosaic_gpu/refused.py refuses {stale}, which {PAGE.path.name} marks supported "
        "or does not list. Fix: remove them from refused.REFUSED.")
    for name in NOT_SUPPORTED:
        assert not re.search(r"[.:]$", refused.REFUSED[name][1][1]), name  # message adds it


def test_supported_names_are_real() -> None:
    from pallas_mosaic_gpu.refused import Refused
    fake = [r.name for r in PAGE.rows
            if r.status == "supported" and isinstance(getattr(plgpu, r.name), Refused)]
    assert not fake, f"rows marked supported but refused by plgpu: {fake}"
    with pytest.raises(AttributeError):
        plgpu.no_such_name  # noqa: B018
