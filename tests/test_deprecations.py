"""Names JAX moved or removed keep working here at every supported JAX, and warn exactly where
the installed JAX warns (issue 28): the reference is JAX's own module, asked the same name."""

from __future__ import annotations

import importlib
import warnings

import pytest

from pallas_core import _jax

MOVED = [
    ("jax.experimental.pallas", "pallas_core", "DeviceIdType", "pallas_core.primitives"),
    ("jax.experimental.pallas", "pallas_core", "core_map", "pallas_core.kernel"),
    ("jax.experimental.pallas", "pallas_core", "reciprocal", "pallas_core.extras"),
    ("jax.experimental.pallas", "pallas_core", "dot", "pallas_core.extras"),
    ("jax.experimental.pallas", "pallas_core", "debug_checks_enabled", "pallas_core.extras"),
    ("jax.experimental.pallas.tpu", "pallas_mosaic_tpu", "BufferedRefBase",
     "pallas_mosaic_tpu.pipeline"),
    ("jax.experimental.pallas.tpu", "pallas_mosaic_tpu", "create_tensorcore_mesh",
     "pallas_mosaic_tpu.params"),
    ("jax.experimental.pallas.tpu", "pallas_mosaic_tpu", "HOST", "pallas_core"),
    ("jax.experimental.pallas.mosaic_gpu", "pallas_mosaic_gpu", "transpose_ref",
     "pallas_mosaic_gpu.transforms"),
]


def _lookup(module: object, name: str) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, name)
    return value, [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize(("jax_name", "ours_name", "name", "home"), MOVED,
                         ids=[f"{m[1]}.{m[2]}" for m in MOVED])
def test_moved_names_work_and_warn_where_jax_warns(jax_name: str, ours_name: str, name: str,
                                                   home: str) -> None:
    try:
        theirs = importlib.import_module(jax_name)
    except ImportError as e:  # e.g. JAX's Mosaic GPU module without absl-py
        pytest.skip(f"{jax_name} cannot be imported here: {e}")
    ours = pytest.importorskip(ours_name)
    # JAX warns for the names of its module's deprecation table (once a process: its lookup is
    # cached, so the table is asked, not the warning), and a name it removed altogether was
    # warned for in the releases before.
    jax_warns = name in getattr(theirs, "_deprecations", {}) or not hasattr(theirs, name)
    value, our_warnings = _lookup(ours, name)
    assert value is getattr(importlib.import_module(home), name)
    assert bool(our_warnings) == jax_warns, (jax_name, name, our_warnings)
    if our_warnings:
        assert "Fix:" in our_warnings[0] or "still works" in our_warnings[0]
    assert name in dir(ours)


def test_a_moved_name_warns_from_its_release_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import pallas_core as pl

    moved = pl._MOVED.names["DeviceIdType"]
    monkeypatch.setattr(_jax, "JAX_VERSION", (0, 11, 2))
    assert not _lookup(pl, "DeviceIdType")[1]
    monkeypatch.setattr(_jax, "JAX_VERSION", (*moved.since, 0))
    assert _lookup(pl, "DeviceIdType")[1]
