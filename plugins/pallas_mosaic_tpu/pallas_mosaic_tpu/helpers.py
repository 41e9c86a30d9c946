"""Meshes and helpers of ``jax.experimental.pallas.tpu`` written over the core's primitives:
``CoreType``, ``TensorCoreMesh``, ``run_on_first_core``, ``core_barrier`` and ``einshape``."""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import pallas_core as pl
from pallas_core import Mesh
from pallas_core.backend import PallasError
from pallas_mosaic_tpu.params import NAME, GridDimensionSemantics


class CoreType(enum.Enum):
    """The kind of core a mesh runs on: TensorCores (``TC``), or a SparseCore's scalar or
    vector subcores."""

    TC = "tc"
    SC_SCALAR_SUBCORE = "sc_scalar_subcore"
    SC_VECTOR_SUBCORE = "sc_vector_subcore"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return self.name


class TensorCoreMesh(Mesh):
    """A mesh of ``num_cores`` TensorCores along the one axis ``axis_name``, for ``pl.kernel``
    and ``pl.core_map`` (as ``pltpu.create_tensorcore_mesh(axis_name, num_cores=...)``).

    No device is queried: ``num_cores`` defaults to 1 (give 2 for a megacore v4 or v5p).
    """

    def __init__(self, *, axis_name: str, num_cores: int = 1) -> None:
        if not isinstance(axis_name, str):
            raise PallasError(f"pltpu.TensorCoreMesh(axis_name={axis_name!r}): expected a str. "
                              "Fix: e.g. TensorCoreMesh(axis_name='core', num_cores=2).")
        if isinstance(num_cores, bool) or not isinstance(num_cores, int) or num_cores < 1:
            raise PallasError(f"pltpu.TensorCoreMesh(num_cores={num_cores!r}): expected a "
                              "positive int (TensorCores per device: 1, or 2 on v4/v5p).")
        super().__init__((axis_name,), (num_cores,), backend=NAME)

    @property
    def axis_name(self) -> str:
        """The mesh's one axis."""
        return self.axis_names[0]

    @property
    def num_cores(self) -> int:
        """The TensorCores along the axis."""
        return self.axis_sizes[0]

    @property
    def core_type(self) -> CoreType:
        """Always :attr:`CoreType.TC`."""
        return CoreType.TC

    @property
    def dimension_semantics(self) -> list[GridDimensionSemantics]:
        """The mesh axis is parallel."""
        return [GridDimensionSemantics.PARALLEL]

    def __repr__(self) -> str:
        return f"TensorCoreMesh(axis_name={self.axis_name!r}, num_cores={self.num_cores})"


def run_on_first_core(core_axis_name: str) -> Callable[[Callable[[], Any]], Any]:
    """A decorator running the function it decorates (no arguments) at once, on core 0 of
    the mesh axis ``core_axis_name`` only. With one core on the axis the function's result is
    returned; otherwise it runs under ``pl.when`` and gives ``None``."""
    if lax.axis_size(core_axis_name) == 1:
        return lambda f: f()

    def run(f: Callable[[], Any]) -> None:
        pl.when(lax.axis_index(core_axis_name) == 0)(f)

    return run


def core_barrier(sem: Any, *, core_axis_name: str) -> None:
    """Waits until every core of the mesh axis ``core_axis_name`` has reached this barrier:
    each core signals ``sem`` (a regular semaphore) of every other core, then waits for the
    signals of the others."""
    num_cores = lax.axis_size(core_axis_name)
    if num_cores == 1:
        return
    me = lax.axis_index(core_axis_name)

    def signal(i: int) -> None:
        pl.semaphore_signal(sem, 1, core_index=i)

    for i in range(num_cores):
        pl.when(me != i)(functools.partial(signal, i))
    pl.semaphore_wait(sem, num_cores - 1)


# --- einshape --------------------------------------------------------------------------------


def _groups(side: str, equation: str) -> list[list[str]]:
    """One side of an einshape equation as its groups of axis names: ``"a(bc)"`` is
    ``[["a"], ["b", "c"]]``."""
    groups: list[list[str]] = []
    open_group: list[str] | None = None
    for ch in side.replace(" ", ""):
        if ch == "(":
            if open_group is not None:
                raise PallasError(f"pltpu.einshape({equation!r}): groups cannot nest.")
            open_group = []
        elif ch == ")":
            if open_group is None:
                raise PallasError(f"pltpu.einshape({equation!r}): ')' closes no group.")
            groups.append(open_group)
            open_group = None
        elif open_group is not None:
            open_group.append(ch)
        else:
            groups.append([ch])
    if open_group is not None:
        raise PallasError(f"pltpu.einshape({equation!r}): a '(' is never closed.")
    return groups


def _axis_sizes(lhs: list[list[str]], shape: tuple[int, ...], sizes: dict[str, int],
                equation: str) -> dict[str, int]:
    if len(lhs) != len(shape):
        raise PallasError(f"pltpu.einshape({equation!r}): the left side has {len(lhs)} "
                          f"dimensions but the array has shape {shape}.")
    known: dict[str, int] = {}
    for group, dim in zip(lhs, shape):
        if len(group) == 1:
            if group[0] in known and known[group[0]] != dim:
                raise PallasError(f"pltpu.einshape({equation!r}): axis {group[0]!r} has sizes "
                                  f"{known[group[0]]} and {dim}.")
            known[group[0]] = dim
            continue
        for name in group:
            if name in sizes:
                known[name] = sizes[name]
        unknown = [n for n in group if n not in known]
        product = math.prod(known[n] for n in group if n in known)
        if len(unknown) > 1:
            raise PallasError(
                f"pltpu.einshape({equation!r}): cannot split {dim} into {''.join(group)} with "
                f"{', '.join(unknown)} unknown. Fix: give all but one size, e.g. "
                f"einshape(..., {unknown[0]}=...).")
        if unknown and product and dim % product == 0:
            known[unknown[0]] = dim // product
        elif unknown or product != dim:
            raise PallasError(f"pltpu.einshape({equation!r}): dimension {dim} cannot be split "
                              f"into {''.join(group)} with sizes "
                              f"{ {n: known[n] for n in group if n in known} }.")
    return known


def einshape(equation: str, x: jax.Array, assert_is_tile_preserving: bool = False,
             **sizes: int) -> jax.Array:
    """Reshapes and transposes ``x`` as ``equation`` says: ``"a(bc)->(ba)c"`` splits the second
    dimension into ``b`` and ``c``, swaps ``a`` and ``b`` and merges them. Sizes that cannot be
    inferred from ``x``'s shape are given by keyword (``einshape("(ab)c->bac", x, a=2)``).

    ``assert_is_tile_preserving`` is accepted and not checked: this lowering reshapes and
    transposes with the general rules.
    """
    del assert_is_tile_preserving
    if equation.count("->") != 1:
        raise PallasError(f"pltpu.einshape({equation!r}): expected one '->' between the two "
                          "sides, e.g. 'ab->ba'.")
    x = jnp.asarray(x)
    lhs_text, rhs_text = equation.split("->")
    lhs, rhs = _groups(lhs_text, equation), _groups(rhs_text, equation)
    known = _axis_sizes(lhs, tuple(x.shape), sizes, equation)
    before = [n for g in lhs for n in g]
    after = [n for g in rhs for n in g]
    if sorted(before) != sorted(after) or len(set(before)) != len(before):
        raise PallasError(f"pltpu.einshape({equation!r}): both sides must name the same axes, "
                          "each once (einshape reorders, splits and merges; it does not add, "
                          "drop or repeat axes).")
    split = x.reshape([known[n] for n in before])
    moved = jnp.transpose(split, [before.index(n) for n in after]) if before != after else split
    return moved.reshape([math.prod(known[n] for n in g) for g in rhs])


def touch(ref: Any) -> None:
    """Marks ``ref`` (or a PyTree of Refs) as read and written here, an ordering hint for
    Mosaic's scheduler that moves no data. Kernels here run their Ref accesses in program
    order, so the hint changes nothing and nothing is emitted (as JAX's lowering emits
    nothing)."""
    del ref
