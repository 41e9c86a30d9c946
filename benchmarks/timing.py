"""Timing helpers shared by the benchmarks: warm-up, then the median of repeated calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def call_seconds(fn: Callable[..., Any], args: list[jax.Array]) -> float:
    """Seconds one call of ``fn(*args)`` takes, results ready."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def median_seconds(fn: Callable[..., Any], args: list[jax.Array], warmup: int,
                   repeats: int) -> float:
    """Median seconds per call of ``fn(*args)`` over ``repeats`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    return statistics.median(call_seconds(fn, args) for _ in range(repeats))
