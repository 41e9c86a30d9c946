"""``examples/sparsecore.py`` runs: its four kernels match jax.numpy in the interpreter and
lower for v7x SparseCores."""

from __future__ import annotations

import importlib
import pathlib
import sys

import pytest

pytest.importorskip("pallas_sparsecore")


def test_example_runs() -> None:
    root = str(pathlib.Path(__file__).resolve().parents[3])
    if root not in sys.path:
        sys.path.insert(0, root)
    importlib.import_module("examples.sparsecore").main()
