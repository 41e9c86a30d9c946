"""The order in which the step-by-step interpreter visits the grid, and which simulated core
runs each step.

Step ``k`` is the ``k``-th point of the grid in lexicographic order, with the indices along each
parallel axis permuted when ``shuffle_seed`` is set (one ``jax.random`` permutation per parallel
axis, drawn in axis order from ``jax.random.key(seed)``, as JAX's TPU interpret mode draws
them). With ``num_cores`` cores, the parallel axes (which must lead the grid) are split into
``num_cores`` contiguous chunks of ``ceil(P / num_cores)`` points of the parallel subgrid (of
``P`` points); core ``c`` runs the steps of chunk ``c``, each point of the parallel subgrid with
all the steps of the remaining axes. The cores run one after another here, each with its own
scratch and block buffers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core.backend import PallasError
from pallas_interpret import blocks


class ParallelAxesError(PallasError, ValueError):
    """The parallel grid axes cannot be split between cores as asked."""


class DynamicParallelAxisError(PallasError, jax.errors.ConcretizationTypeError):
    """A parallel grid axis to shuffle has a size known only at run time."""

    def __init__(self, message: str) -> None:
        jax.errors.JAXTypeError.__init__(self, message)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The visiting order of a grid: ``perms[a]`` permutes the indices of axis ``a`` (``None``:
    in order); step ``k`` runs on core ``k // steps_per_core``. Sizes of dynamic grid axes,
    and so ``steps_per_core``, may be traced; :meth:`points` and the methods built on it need
    a static grid."""

    grid: tuple[Any, ...]
    perms: tuple[np.ndarray | None, ...]
    num_cores: int
    steps_per_core: Any

    @property
    def num_steps(self) -> Any:
        return math.prod(self.grid)

    def point(self, k: Any) -> tuple[Any, ...]:
        """The grid indices of step ``k`` (traced)."""
        ids = blocks.unravel(k, self.grid)
        return tuple(i if p is None else jnp.asarray(p, jnp.int32)[i]
                     for i, p in zip(ids, self.perms))

    def core(self, k: Any) -> Any:
        """The core that runs step ``k`` (traced)."""
        return k // self.steps_per_core

    def first_of_core(self, k: Any) -> Any:
        """Whether step ``k`` is the first its core runs (traced)."""
        return k % self.steps_per_core == 0

    def points(self) -> np.ndarray:
        """Every step's grid indices, in the order the steps run: ``(num_steps, ndim)``."""
        n = self.num_steps
        ids = np.indices(self.grid, dtype=np.int64).reshape(len(self.grid), n)
        for a, p in enumerate(self.perms):
            if p is not None:
                ids[a] = np.asarray(p)[ids[a]]
        return ids.T

    def cores(self) -> np.ndarray:
        """Every step's core, in the order the steps run."""
        return np.arange(self.num_steps) // self.steps_per_core

    def cores_by_point(self) -> np.ndarray:
        """The core of each grid point, the points in lexicographic order."""
        out = np.zeros(self.num_steps, np.int64)
        if self.grid:
            out[np.ravel_multi_index(tuple(self.points().T), self.grid)] = self.cores()
        return out


def permutations(grid: Sequence[int], axes: Sequence[int], seed: int) -> tuple[Any, ...]:
    """Per grid axis, a permutation of its indices for the axes in ``axes`` (else ``None``)."""
    with jax.ensure_compile_time_eval():
        key = jax.random.key(seed)
        perms: list[Any] = []
        for a, n in enumerate(grid):
            if a in axes:
                key, sub = jax.random.split(key)
                perms.append(np.asarray(jax.random.permutation(sub, jnp.arange(n,
                                                                                dtype=jnp.int32))))
            else:
                perms.append(None)
    return tuple(perms)


def _static(n: Any) -> bool:
    return isinstance(n, (int, np.integer))


def make(grid: Sequence[Any], parallel: Sequence[int], seed: int | None, num_cores: int,
         kernel: str) -> Schedule:
    """The schedule of ``grid`` whose ``parallel`` axes are shuffled by ``seed`` (if given) and
    split between ``num_cores`` cores."""
    grid = tuple(int(n) if _static(n) else n for n in grid)
    dynamic = [a for a in parallel if not _static(grid[a])]
    if seed is not None and dynamic:
        raise DynamicParallelAxisError(
            f"kernel {kernel!r} shuffles its parallel grid axes (InterpretParams random_seed / "
            f"shuffle_seed, which JAX's TPU interpret mode always applies), but axes "
            f"{tuple(dynamic)} have sizes known only at run time, and a shuffle needs them "
            "when the kernel is traced. Fix: give those axes int sizes, or make them "
            "'arbitrary'.")
    perms = ((None,) * len(grid) if seed is None or not parallel
             else permutations(grid, parallel, seed))
    n = math.prod(grid)
    if num_cores == 1 or (_static(n) and n == 0):
        return Schedule(grid, perms, 1, n if not _static(n) else max(n, 1))
    if sorted(parallel) != list(range(len(parallel))):
        raise ParallelAxesError(
            f"kernel {kernel!r} runs on {num_cores} cores, which split the parallel grid axes "
            f"between them, but the parallel axes {tuple(sorted(parallel))} of its grid "
            f"do not lead it. Fix: put the parallel axes first (dimension_semantics "
            "such as ('parallel', 'arbitrary')), or run on one core.")
    sub = math.prod(grid[a] for a in parallel)
    per_core = -(-sub // num_cores) * (n // sub)
    return Schedule(grid, perms, num_cores, per_core)
