"""Every public name of the installed JAX's Pallas modules exists in ours (issue 28).

For each of ``jax.experimental.pallas`` and its ``tpu``, ``triton``, ``mosaic_gpu`` and
``tpu_sc`` modules (a module is skipped when JAX cannot import it or our plugin is not
installed), every name ``dir()`` lists without a leading underscore (submodules aside) must be
listed by ``dir()`` of our module too, and looking it up must give a value: a name that only a
refusing ``__getattr__`` answers does not count. The names still missing are in
:data:`KNOWN_GAPS`, each with the reason; an entry whose name now exists fails here, so the
table only shrinks.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import pytest

OURS = {
    "jax.experimental.pallas": "pallas_core",
    "jax.experimental.pallas.tpu": "pallas_mosaic_tpu",
    "jax.experimental.pallas.triton": "pallas_triton",
    "jax.experimental.pallas.mosaic_gpu": "pallas_mosaic_gpu",
    "jax.experimental.pallas.tpu_sc": "pallas_sparsecore",
}
"""JAX's module -> ours."""

KNOWN_GAPS: dict[str, dict[str, str]] = {
    "jax.experimental.pallas": {},
    "jax.experimental.pallas.tpu": {},
    "jax.experimental.pallas.triton": {},
    "jax.experimental.pallas.mosaic_gpu": {},
    "jax.experimental.pallas.tpu_sc": {},
}
"""Names of JAX's modules (any supported version) that ours lack yet, with the reason."""


def _modules(jax_name: str) -> tuple[ModuleType, ModuleType]:
    try:
        theirs = importlib.import_module(jax_name)
    except ImportError as e:  # e.g. a JAX build without this backend's module
        pytest.skip(f"{jax_name} cannot be imported here: {e}")
    ours = pytest.importorskip(OURS[jax_name])
    return theirs, ours


def _public(module: ModuleType) -> set[str]:
    def submodule(n: str) -> bool:
        value = getattr(module, n, None)
        return isinstance(value, ModuleType) and value.__name__ == f"{module.__name__}.{n}"

    return {n for n in dir(module) if not n.startswith("_") and not submodule(n)}


@pytest.mark.parametrize("jax_name", sorted(OURS))
def test_every_public_name_exists_in_ours(jax_name: str) -> None:
    theirs, ours = _modules(jax_name)
    listed = set(dir(ours))
    gaps = KNOWN_GAPS[jax_name]
    missing = sorted(n for n in _public(theirs) - listed if n not in gaps)
    assert not missing, (
        f"{jax_name} lists {missing}, which {ours.__name__} lacks (not in its dir()). Fix: "
        f"write them with JAX's signature and meaning (or, while another change adds them, "
        "list them in KNOWN_GAPS with the reason).")
    broken = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # moved names still work
        for name in sorted(_public(theirs) & listed):
            try:
                getattr(ours, name)
            except AttributeError as e:
                broken.append(f"{name}: {e}")
    assert not broken, f"{ours.__name__} lists names that refuse to be looked up: {broken}"


@pytest.mark.parametrize("jax_name", sorted(OURS))
def test_known_gaps_only_name_missing_names(jax_name: str) -> None:
    _, ours = _modules(jax_name)
    done = sorted(n for n in KNOWN_GAPS[jax_name] if n in dir(ours))
    assert not done, (f"{ours.__name__} now has {done}: remove them from KNOWN_GAPS"
                      f"[{jax_name!r}].")
