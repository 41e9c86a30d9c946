"""Checking a moved name's deprecation at the installed JAX, for backends' tests."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest

from pallas_core import _jax


@contextlib.contextmanager
def warns_from(since: tuple[int, int], match: str) -> Iterator[None]:
    """The body looks a moved name up. From JAX ``since`` on it must warn (a
    ``DeprecationWarning`` matching ``match``), as JAX does; before, it must not warn at all."""
    if _jax.JAX_VERSION[:2] >= since:
        with pytest.warns(DeprecationWarning, match=match):
            yield
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield
