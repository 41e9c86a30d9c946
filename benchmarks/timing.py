"""Timing helpers shared by the benchmarks: warm-up, then the median of repeated calls."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def command_line(doc: str, warmup: int, repeats: int) -> argparse.ArgumentParser:
    """A benchmark's command line, described by the first line of ``doc``, with ``--warmup``
    (calls before timing) and ``--repeats`` (timed calls or rounds) defaulting as given."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser


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


def paired_medians(ways: dict[str, tuple[Callable[..., Any], list[Any]]], warmup: int,
                   repeats: int, min_sample_s: float = 0.02) -> dict[str, float]:
    """Median seconds per call of each way, timed side by side.

    After ``warmup`` calls of each, ``repeats`` rounds each take one sample of every way, in
    an order that alternates from round to round, so that a drift of the machine's speed
    touches all ways alike. A sample times as many back-to-back calls as it takes to fill
    ``min_sample_s`` (the same count for every round), divided by that count.
    """
    counts = {}
    for name, (fn, args) in ways.items():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
        once = call_seconds(fn, args)
        counts[name] = max(1, int(min_sample_s / max(once, 1e-6)))
    samples: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn, args = ways[name]
            start = time.perf_counter()
            for _ in range(counts[name]):
                out = fn(*args)
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - start) / counts[name])
    return {name: statistics.median(s) for name, s in samples.items()}
