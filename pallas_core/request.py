"""The frozen description of one kernel launch that every backend receives."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pallas_core import _jax, semantics
from pallas_core.grid_mapping import GridMapping
from pallas_core.spec import CostEstimate


@dataclasses.dataclass(frozen=True, eq=False)
class KernelCall:
    """One ``pallas_call`` as bound in a program: the traced kernel and how it is launched.

    ``jaxpr`` takes one Ref per input block, output block and scratch buffer (in that order)
    and returns nothing. ``program_id(i)`` inside it refers to axis
    ``i + grid_mapping.num_batch_axes`` of ``grid_mapping.grid``.
    """

    name: str
    jaxpr: Any
    grid_mapping: GridMapping
    out_avals: tuple[Any, ...]
    backend: str | None = None
    """The backend chosen at call time, or ``None`` to choose by platform when lowering."""
    compiler_params: Any = None
    input_output_aliases: tuple[tuple[int, int], ...] = ()
    cost_estimate: CostEstimate | None = None
    debug: bool = False
    interpret: Any = False
    source: str = "<unknown>"
    """``file:line`` where the kernel function was defined."""

    def replace(self, **changes: Any) -> KernelCall:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    @property
    def symbolic_dims(self) -> tuple[Any, ...]:
        """The distinct symbolic dimensions the kernel sees (``jax.export`` with shape
        polymorphism), in the order a lowering meets them: its operands (blocks, then
        scratch), its body, the index maps, then the grid's sizes. Empty for a kernel of
        static shapes. (The shapes of the arrays outside the kernel are not counted.)"""
        seen: dict[Any, None] = {}

        def note(d: Any) -> Any:
            seen.setdefault(d, None)
            return d

        gm = self.grid_mapping
        _jax.map_dims(([v.aval for v in self.jaxpr.jaxpr.invars], self.jaxpr,
                       [bm.index_map for bm in gm.block_mappings], gm.symbolic_sizes), note)
        return tuple(seen)

    def with_dims(self, fn: Callable[[Any], int]) -> KernelCall:
        """This call with each symbolic dimension ``d`` replaced by the int ``fn(d)``:
        in the grid (a dynamic axis given as a symbolic size becomes static), the blocks,
        arrays and scratch, the index maps and the kernel's jaxpr. For a backend that writes
        symbolic dimensions as placeholder constants (Mosaic TPU's dynamic-shape export)."""
        gm = self.grid_mapping
        if gm.symbolic_sizes:
            sizes = iter((None,) * gm.num_batch_axes + gm.symbolic_sizes)
            grid = tuple(fn(s) if (s := next(sizes)) is not None else g for g in gm.grid)
            gm = dataclasses.replace(gm, grid=grid, symbolic_sizes=())
        return _jax.map_dims(self.replace(grid_mapping=gm), fn)  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True, eq=False)
class LoweringRequest:
    """A request to lower ``call`` with ``backend`` for ``platform`` inside a JAX program."""

    call: KernelCall
    backend: str
    platform: str
    ctx: Any
    """JAX's MLIR lowering-rule context (for emitting custom calls)."""
    operands: tuple[Any, ...]
    """The MLIR values of the call's inputs."""

    @property
    def device_axes(self) -> tuple[tuple[str, int], ...]:
        """``(name, size)`` of the ``shard_map`` mesh axes the kernel runs under (else empty)."""
        return _jax.manual_axes(self.ctx)

    def device_mesh(self) -> contextlib.AbstractContextManager[None]:
        """A context in which the ``shard_map``'s device mesh (if the kernel runs under one) is
        JAX's current concrete mesh, for kernel libraries that read it while building a kernel
        (e.g. to size the metadata devices exchange); it changes nothing elsewhere."""
        return _jax.shard_map_device_mesh(self.ctx)

    def lower_jax(self, fn: Callable[..., Sequence[Any]]) -> Sequence[Any]:
        """Inlines ``fn(*inputs) -> outputs`` (plain JAX) into the program being lowered.

        Under ``shard_map`` the mesh axes are in scope while ``fn`` is traced, and the reference
        semantics of cross-device primitives (remote copies and signals) use them.
        """
        def traced(*args: Any) -> Sequence[Any]:
            with semantics.device_axes(self.device_axes):
                return fn(*args)
        return _jax.lower_fun(traced, multiple_results=True)(self.ctx, *self.operands)  # type: ignore[no-any-return]
