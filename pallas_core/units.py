"""Quantities as people read them: ``1.5 TFLOP``, ``512 KiB``, ``698 us`` (``pl.report``'s
table and page)."""

from __future__ import annotations


def si(x: float, unit: str) -> str:
    """``x`` with an SI prefix (k, M, G, T, P) and ``unit``, three significant digits."""
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}{unit}".rstrip()
    return f"{x:.3g} {unit}".rstrip()


def nbytes(n: float) -> str:
    """A size in bytes with a binary prefix (KiB, MiB, GiB)."""
    for div, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.3g} {name}"
    return f"{int(n)} B"


def seconds(s: float) -> str:
    """A duration in s, ms, us or ns."""
    for div, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if s >= div:
            return f"{s / div:.3g} {name}"
    return f"{s / 1e-9:.3g} ns"
