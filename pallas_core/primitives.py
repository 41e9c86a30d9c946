"""Primitives and helpers used inside kernels: ``program_id``, loads/stores, atomics, ...

Each primitive here is backend-neutral; its reference semantics (what the interpreter
runs) are registered in :mod:`pallas_core.semantics`, and each backend lowers it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import string
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_core import _jax
from pallas_core.errors import KernelSignatureError, PallasError, UnsupportedError
from pallas_core.spec import MemoryRef


@dataclasses.dataclass(frozen=True)
class KernelTraceContext:
    """What is known about the grid while a kernel body is being traced."""

    grid: tuple[int, ...]
    grid_names: tuple[str, ...] | None = None


_TRACE_CONTEXT: contextvars.ContextVar[KernelTraceContext | None] = contextvars.ContextVar(
    "pallas_kernel_trace_context", default=None
)


@contextlib.contextmanager
def _bound(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def current_kernel_context() -> KernelTraceContext | None:
    """The grid of the kernel being traced (``None`` outside a kernel body)."""
    return _TRACE_CONTEXT.get()


def kernel_trace_context(ctx: KernelTraceContext) -> contextlib.AbstractContextManager[None]:
    """Makes ``ctx`` the grid that ``program_id``/``num_programs`` refer to while tracing."""
    return _bound(_TRACE_CONTEXT, ctx)


class BarrierSemaphoreNeeded(Exception):  # noqa: N818 - a signal to the tracer, not an error
    """Raised by :func:`barrier_semaphore` on a first trace, which is then redone with the
    barrier semaphore as a hidden last scratch operand."""


_BARRIER: contextvars.ContextVar[Any] = contextvars.ContextVar("pallas_barrier_semaphore",
                                                               default=None)


def barrier_semaphore_context(ref: Any) -> contextlib.AbstractContextManager[None]:
    """Makes ``ref`` what :func:`barrier_semaphore` returns while a kernel is traced."""
    return _bound(_BARRIER, ref)


def barrier_semaphore() -> Any:
    """The kernel's barrier semaphore: an int32 semaphore Ref that other devices running the
    same collective signal (``pl.semaphore_signal(sem, 1, device_id=...)``).

    Backends expose it by name (``pltpu.get_barrier_semaphore()``). Kernels using it must be
    waited back to zero before they end, and need a ``collective_id`` on TPU.
    """
    _current_grid("get_barrier_semaphore")
    ref = _BARRIER.get()
    if ref is None:
        raise BarrierSemaphoreNeeded()
    return ref


def _current_grid(fn: str) -> tuple[int, ...]:
    ctx = _TRACE_CONTEXT.get()
    if ctx is None:
        raise PallasError(
            f"pl.{fn} was called outside a kernel. It is only meaningful inside the body of "
            "a function passed to pl.pallas_call or pl.kernel."
        )
    return ctx.grid


def _check_axis(fn: str, axis: int) -> int:
    grid = _current_grid(fn)
    if not isinstance(axis, int) or not 0 <= axis < len(grid):
        raise PallasError(
            f"pl.{fn}(axis={axis!r}) but the grid {grid} has {len(grid)} axes. "
            f"Fix: pass an axis in range({len(grid)}), or add the axis to the grid."
        )
    return axis


# --- grid position ---------------------------------------------------------------------

program_id_p = _jax.Primitive("program_id")
program_id_p.def_abstract_eval(lambda *, axis: _jax.ShapedArray((), jnp.int32))


_GRID_ENV: contextvars.ContextVar[tuple[tuple[Any, ...], tuple[int, ...]] | None] = (
    contextvars.ContextVar("pallas_grid_env", default=None))


def grid_env(indices: Sequence[Any], sizes: Sequence[int]
             ) -> contextlib.AbstractContextManager[None]:
    """Inside, ``program_id(d)`` is ``indices[d]`` and ``num_programs(d)`` is ``sizes[d]``.

    For grids run by kernel code itself, such as a software pipeline's (``emit_pipeline``):
    its body sees the pipeline's step, as it would see a ``pallas_call``'s.
    """
    return _bound(_GRID_ENV, (tuple(indices), tuple(int(s) for s in sizes)))


def _env_axis(fn: str, axis: int) -> tuple[tuple[Any, ...], tuple[int, ...]] | None:
    env = _GRID_ENV.get()
    if env is not None and (not isinstance(axis, int) or not 0 <= axis < len(env[1])):
        raise PallasError(f"pl.{fn}(axis={axis!r}) inside a pipeline over the grid {env[1]}. "
                          f"Fix: pass an axis in range({len(env[1])}).")
    return env


def program_id(axis: int) -> jax.Array:
    """The index of the current grid step along ``axis`` (an int32 scalar)."""
    env = _env_axis("program_id", axis)
    if env is not None:
        return jnp.asarray(env[0][axis], jnp.int32)
    return program_id_p.bind(axis=_check_axis("program_id", axis))


num_programs_p = _jax.Primitive("num_programs")
num_programs_p.def_abstract_eval(lambda *, axis: _jax.ShapedArray((), jnp.int32))


def num_programs(axis: int) -> int | jax.Array:
    """The size of the grid along ``axis``: an int, or a traced int32 scalar for an axis of a
    dynamic grid (a size given as a JAX array). A symbolic size (``jax.export``) is itself
    inside ``pl.pallas_export_experimental(dynamic_shapes=True)``, as in JAX."""
    env = _env_axis("num_programs", axis)
    if env is not None:
        return env[1][axis]
    size = _current_grid("num_programs")[_check_axis("num_programs", axis)]
    if isinstance(size, int) or _jax.is_symbolic_dim(size):
        return size
    return num_programs_p.bind(axis=axis)


# --- hints and debugging -----------------------------------------------------------------

multiple_of_p = _jax.Primitive("multiple_of")
multiple_of_p.def_abstract_eval(lambda x, *, values: x)


def multiple_of(x: jax.Array, values: int | Sequence[int]) -> jax.Array:
    """Tells the compiler that ``x`` is a multiple of ``values``; returns ``x`` unchanged."""
    values = (values,) if isinstance(values, int) else tuple(values)
    return multiple_of_p.bind(x, values=values)


class DebugPrintEffect(_jax.Effect):
    """Marks a kernel that prints, so that the print is never removed as dead code."""


debug_print_effect = DebugPrintEffect()
debug_print_p = _jax.effect_primitive("debug_print", debug_print_effect)


def debug_print(fmt: str, *args: Any) -> None:
    """Prints ``fmt`` with ``{}`` placeholders replaced by ``args`` (scalars or arrays; a Ref
    prints its contents)."""
    if not isinstance(fmt, str):
        raise PallasError(f"pl.debug_print expects a format string first, found {fmt!r}.")
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError as e:
        raise PallasError(f"pl.debug_print format {fmt!r} is not a format string: {e}. Fix: "
                          "write '{{' and '}}' for literal braces.") from e
    for _, field, spec, conversion in fields:
        if spec or conversion or field:
            what = (f"the format spec ':{spec}'" if spec else f"the conversion '!{conversion}'"
                    if conversion else f"the field name {field!r}")
            raise PallasError(
                f"pl.debug_print format {fmt!r} has {what}; kernels print with plain '{{}}' "
                "placeholders, one per value, in order (as jax.experimental.pallas requires). "
                "Fix: write '{}' and round or convert the value in the kernel.")
    args = tuple(a[...] if _is_ref(a) else a for a in args)
    if args and "{}" not in fmt:
        fmt = fmt + " {}" * len(args)  # values appended, as Triton's print does
    if fmt.count("{}") != len(args):
        raise PallasError(
            f"pl.debug_print format {fmt!r} has {fmt.count('{}')} '{{}}' placeholders but "
            f"{len(args)} values were given. Fix: use one '{{}}' per value."
        )
    debug_print_p.bind(*(jnp.asarray(a) for a in args), fmt=fmt)


def _is_ref(value: Any) -> bool:
    try:
        return isinstance(_jax.ref_type_of(value), _jax.AbstractRef)
    except TypeError:  # not a JAX value at all
        return False


# --- memory access -------------------------------------------------------------------------


def _ref_and_transforms(ref: Any, idx: Any, fn: str,
                        masked: bool = False) -> tuple[Any, tuple[Any, ...]]:
    if isinstance(idx, list):
        idx = tuple(idx)
    get = _jax.get_ref_and_transforms_past_the_end if masked else _jax.get_ref_and_transforms
    try:
        return get(ref, idx, fn)  # type: ignore[no-any-return]
    except (ValueError, TypeError) as e:
        if _jax.out_of_bound_slice(e):
            raise  # reported with the kernel's name and the line by the kernel's trace
        raise PallasError(f"pl.{fn}: {e}") from e


def _flat_access(ref: Any, idx: Any, fn: str,
                 masked: bool = False) -> tuple[Any, list[Any], Any, Any]:
    ref, transforms = _ref_and_transforms(ref, idx, fn, masked)
    flat, tree = jax.tree_util.tree_flatten(transforms)
    out_aval = _jax.shape_after_transforms(_jax.ref_type_of(ref), transforms)
    return ref, flat, tree, out_aval


def _access_aval(ref_aval: Any, flat: Sequence[Any], tree: Any) -> Any:
    transforms = jax.tree_util.tree_unflatten(tree, flat)
    return _jax.shape_after_transforms(ref_aval, transforms)


masked_load_p = _jax.Primitive("masked_load")


@masked_load_p.def_effectful_abstract_eval
def _masked_load_abstract_eval(ref: Any, *args: Any, tree: Any, has_other: bool) -> Any:
    n = tree.num_leaves
    return _access_aval(ref, args[:n], tree), {_jax.ReadEffect(0)}


masked_swap_p = _jax.Primitive("masked_swap")


@masked_swap_p.def_effectful_abstract_eval
def _masked_swap_abstract_eval(ref: Any, val: Any, *args: Any, tree: Any) -> Any:
    return _access_aval(ref, args[: tree.num_leaves], tree), {_jax.WriteEffect(0)}


def _broadcast_like(x: Any, aval: Any, what: str, fn: str) -> jax.Array:
    x = jnp.asarray(x)
    try:
        return jnp.broadcast_to(x, aval.shape)
    except ValueError as e:
        raise PallasError(
            f"pl.{fn}: {what} of shape {x.shape} does not broadcast to the accessed shape "
            f"{aval.shape}."
        ) from e


def load(ref: Any, idx: Any = ..., *, mask: Any = None, other: Any = None) -> jax.Array:
    """Reads ``ref[idx]``; where ``mask`` is False the result is ``other`` (or undefined).

    Masked lanes are never read, so a masked load whose start is computed at run time may reach
    past the end of ``ref`` (a start known at trace time must lie inside it).
    """
    if mask is None:
        if other is not None:
            raise PallasError(
                "pl.load: `other` (the value of masked-off elements) was given without `mask`, "
                "so it would never be used. Fix: pass mask= too, or drop other=."
            )
        r, transforms = _ref_and_transforms(ref, idx, "load")
        return _jax.get_p.bind(r, *jax.tree_util.tree_leaves(transforms),  # type: ignore[no-any-return]
                               tree=jax.tree_util.tree_structure(transforms))
    r, flat, tree, aval = _flat_access(ref, idx, "load", masked=True)
    mask = _broadcast_like(mask, aval, "mask", "load").astype(jnp.bool_)
    args = [*flat, mask]
    if other is not None:
        args.append(_broadcast_like(other, aval, "other", "load").astype(aval.dtype))
    return masked_load_p.bind(r, *args, tree=tree, has_other=other is not None)  # type: ignore[no-any-return]


def swap(ref: Any, idx: Any, val: Any, *, mask: Any = None) -> jax.Array:
    """Writes ``val`` to ``ref[idx]`` (only where ``mask``) and returns the old contents."""
    r, flat, tree, aval = _flat_access(ref, idx, "swap", masked=mask is not None)
    val = _broadcast_like(val, aval, "value", "swap").astype(aval.dtype)
    if mask is None:
        return _jax.swap_p.bind(r, val, *flat, tree=tree)  # type: ignore[no-any-return]
    mask = _broadcast_like(mask, aval, "mask", "swap").astype(jnp.bool_)
    return masked_swap_p.bind(r, val, *flat, mask, tree=tree)  # type: ignore[no-any-return]


def store(ref: Any, idx: Any, val: Any, *, mask: Any = None) -> None:
    """Writes ``val`` to ``ref[idx]``, only where ``mask`` is True when a mask is given."""
    swap(ref, idx, val, mask=mask)


# --- atomics -------------------------------------------------------------------------------


class AtomicOp(enum.Enum):
    """The read-modify-write operation of an atomic."""

    ADD = "add"
    MAX = "max"
    MIN = "min"
    AND = "and"
    OR = "or"
    XOR = "xor"
    XCHG = "xchg"


atomic_rmw_p = _jax.Primitive("atomic_rmw")


@atomic_rmw_p.def_effectful_abstract_eval
def _atomic_rmw_abstract_eval(ref: Any, val: Any, *args: Any, tree: Any, op: AtomicOp,
                              has_mask: bool) -> Any:
    aval = _access_aval(ref, args[: tree.num_leaves], tree)
    return aval, {_jax.ReadEffect(0), _jax.WriteEffect(0)}


atomic_cas_p = _jax.Primitive("atomic_cas")


@atomic_cas_p.def_effectful_abstract_eval
def _atomic_cas_abstract_eval(ref: Any, cmp: Any, val: Any, *args: Any, tree: Any) -> Any:
    aval = _access_aval(ref, args[: tree.num_leaves], tree)
    return aval, {_jax.ReadEffect(0), _jax.WriteEffect(0)}


def _atomic(op: AtomicOp) -> Callable[..., jax.Array]:
    def atomic(ref: Any, idx: Any, val: Any, *, mask: Any = None) -> jax.Array:
        r, flat, tree, aval = _flat_access(ref, idx, f"atomic_{op.value}")
        if op in (AtomicOp.AND, AtomicOp.OR, AtomicOp.XOR) and not jnp.issubdtype(
            aval.dtype, jnp.integer
        ):
            raise PallasError(
                f"pl.atomic_{op.value} needs an integer Ref, found {aval.dtype}. "
                "Fix: use an integer dtype, or atomic_add/max/min for floats."
            )
        val = _broadcast_like(val, aval, "value", f"atomic_{op.value}").astype(aval.dtype)
        args = [*flat]
        if mask is not None:
            args.append(_broadcast_like(mask, aval, "mask", f"atomic_{op.value}")
                        .astype(jnp.bool_))
        return atomic_rmw_p.bind(r, val, *args, tree=tree, op=op,  # type: ignore[no-any-return]
                                 has_mask=mask is not None)

    atomic.__name__ = f"atomic_{op.value}"
    atomic.__doc__ = (
        f"Atomically applies ``{op.value}`` of ``val`` to ``ref[idx]`` (where ``mask``); "
        "returns the previous contents."
    )
    return atomic


atomic_add = _atomic(AtomicOp.ADD)
atomic_max = _atomic(AtomicOp.MAX)
atomic_min = _atomic(AtomicOp.MIN)
atomic_and = _atomic(AtomicOp.AND)
atomic_or = _atomic(AtomicOp.OR)
atomic_xor = _atomic(AtomicOp.XOR)
atomic_xchg = _atomic(AtomicOp.XCHG)


def atomic_cas(ref: Any, cmp: Any, val: Any) -> jax.Array:
    """Atomically: ``old = ref[...]; if old == cmp: ref[...] = val``; returns ``old``."""
    r, flat, tree, aval = _flat_access(ref, ..., "atomic_cas")
    cmp = _broadcast_like(cmp, aval, "cmp", "atomic_cas").astype(aval.dtype)
    val = _broadcast_like(val, aval, "value", "atomic_cas").astype(aval.dtype)
    return atomic_cas_p.bind(r, cmp, val, *flat, tree=tree)  # type: ignore[no-any-return]


# --- semaphores ----------------------------------------------------------------------------
#
# A semaphore is an int32 Ref (a backend keeps it in its semaphore memory space, e.g. TPU's
# SEMAPHORE). Signals add to it, waits block until it reaches a value and subtract it.


class DeviceIdType(enum.Enum):
    """How ``device_id`` names a device: by mesh coordinates or by logical index."""

    MESH = "mesh"
    LOGICAL = "logical"


semaphore_signal_p = _jax.Primitive("semaphore_signal")
semaphore_signal_p.multiple_results = True


@semaphore_signal_p.def_effectful_abstract_eval
def _semaphore_signal_abstract_eval(sem: Any, *args: Any, tree: Any, has_device_id: bool,
                                    device_id_type: DeviceIdType,
                                    has_core_index: bool = False) -> Any:
    return [], {_jax.ReadEffect(0), _jax.WriteEffect(0)}


semaphore_wait_p = _jax.Primitive("semaphore_wait")
semaphore_wait_p.multiple_results = True


@semaphore_wait_p.def_effectful_abstract_eval
def _semaphore_wait_abstract_eval(sem: Any, *args: Any, tree: Any, decrement: bool) -> Any:
    return [], {_jax.ReadEffect(0), _jax.WriteEffect(0)}


semaphore_read_p = _jax.Primitive("semaphore_read")


@semaphore_read_p.def_effectful_abstract_eval
def _semaphore_read_abstract_eval(sem: Any, *args: Any, tree: Any) -> Any:
    return _jax.ShapedArray((), jnp.int32), {_jax.ReadEffect(0)}


def _semaphore_access(sem: Any, fn: str) -> tuple[Any, list[Any], Any]:
    ref, flat, tree, aval = _flat_access(sem, ..., fn)
    if aval.shape != () or aval.dtype != jnp.int32:
        raise PallasError(
            f"pl.{fn} needs one semaphore: an int32 Ref of shape () (index an array of "
            f"semaphores with .at[i]), found {aval.dtype}{list(aval.shape)}."
        )
    return ref, flat, tree


def device_id_operands(device_id: Any, device_id_type: DeviceIdType, fn: str
                       ) -> tuple[list[jax.Array], Any]:
    """``device_id`` as int32 operands, and the core index it names (else ``None``).

    ``device_id`` is a logical index (``DeviceIdType.LOGICAL``), or coordinates along the
    ``shard_map`` mesh axes (``MESH``): one per axis, a bare int for a one-axis mesh, or a dict
    from axis names to coordinates, where the axes it leaves out are this device's own. A dict
    key may be a tuple of axes (a linear index over them, row-major) or an axis of the kernel's
    own mesh (``pl.kernel``), which names the core.
    """
    if not isinstance(device_id_type, DeviceIdType):
        raise PallasError(f"pl.{fn}(device_id_type={device_id_type!r}): expected a "
                          "pl.DeviceIdType (MESH or LOGICAL).")
    if isinstance(device_id, dict):
        if device_id_type is not DeviceIdType.MESH:
            raise PallasError(f"pl.{fn}: a dict device_id names mesh axes, so it needs "
                              "device_id_type=DeviceIdType.MESH.")
        return _device_id_from_axes(device_id, fn)
    ids = tuple(device_id) if isinstance(device_id, (tuple, list)) else (device_id,)
    if device_id_type is DeviceIdType.LOGICAL and len(ids) != 1:
        raise PallasError(f"pl.{fn}: a LOGICAL device_id is one index, found {len(ids)} "
                          "values. Fix: pass one int, or use DeviceIdType.MESH coordinates.")
    return [_int32_operand(i, "device_id", fn) for i in ids], None


def _int32_operand(x: Any, what: str, fn: str) -> jax.Array:
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
    if isinstance(x, bool) or not jnp.issubdtype(dtype, jnp.integer):
        raise PallasError(f"pl.{fn}: {what} must be an integer, found {x!r}.")
    if jnp.shape(x) != ():
        raise PallasError(f"pl.{fn}: {what} must be a scalar, found shape {jnp.shape(x)}.")
    return jnp.asarray(x, jnp.int32)


def _device_id_from_axes(device_id: dict[Any, Any], fn: str) -> tuple[list[jax.Array], Any]:
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    axes = [(n, s) for n, s in zip(mesh.axis_names, mesh.axis_sizes) if n in manual]
    sizes = dict(axes)
    ctx = current_kernel_context()
    cores = dict(zip(ctx.grid_names or (), ctx.grid)) if ctx is not None else {}
    coords: dict[str, Any] = {}
    core = None
    for key, value in device_id.items():
        names = key if isinstance(key, tuple) else (key,)
        value = _int32_operand(value, f"device_id[{key!r}]", fn)
        if len(names) == 1 and names[0] in cores and names[0] not in sizes:
            core = value
        elif len(names) == 1 and names[0] in sizes:
            coords[names[0]] = value  # the coordinate itself, as JAX passes it on
        elif all(n in sizes for n in names):
            for k, n in enumerate(names):  # a linear index over several axes, row-major
                inner = int(np.prod([sizes[m] for m in names[k + 1:]], dtype=np.int64))
                # lax's division and remainder (truncating, one op each, as JAX's own
                # conversion): an index in range is non-negative, where they agree with
                # floor division, and a backend can follow the value back through them.
                coords[n] = lax.rem(lax.div(value, np.int32(inner)), np.int32(sizes[n]))
        else:
            raise PallasError(
                f"pl.{fn}: device_id names the axis {key!r}, but the shard_map mesh axes are "
                f"{tuple(sizes)} and the kernel's core axes {tuple(cores)}. Fix: name those.")
    ids = [coords[n] if n in coords else lax.axis_index(n) for n, _ in axes]
    return ids, core


def semaphore_signal(sem: Any, inc: Any = 1, *, device_id: Any = None,
                     device_id_type: DeviceIdType = DeviceIdType.MESH,
                     core_index: Any = None) -> None:
    """Adds ``inc`` to a semaphore: this core's, or that of core ``core_index`` of the
    kernel's mesh, on this device or on device ``device_id`` (see :func:`device_id_operands`).

    The interpreter runs the cores of a mesh one after another and keeps one copy of each
    semaphore for all of them, so a signal to another core is seen by that core when it runs.
    """
    ref, flat, tree = _semaphore_access(sem, "semaphore_signal")
    args = [*flat, _int32_operand(inc, "inc", "semaphore_signal")]
    core = None
    if device_id is not None:
        ids, core = device_id_operands(device_id, device_id_type, "semaphore_signal")
        if ids:
            args += ids
        else:
            device_id = None  # a dict naming only the core
    if core_index is not None:
        if core is not None:
            raise PallasError("pl.semaphore_signal: the core is named twice, by core_index= "
                              "and by a core axis in device_id. Fix: give one of them.")
        core = _check_core_index(core_index)
    if core is not None:
        args.append(core)
    semaphore_signal_p.bind(ref, *args, tree=tree, has_device_id=device_id is not None,
                            device_id_type=device_id_type, has_core_index=core is not None)


def _check_core_index(core_index: Any) -> jax.Array:
    value = _int32_operand(core_index, "core_index", "semaphore_signal")
    ctx = current_kernel_context()
    cores = int(np.prod(ctx.grid)) if ctx is not None and ctx.grid_names else None
    if isinstance(core_index, (int, np.integer)) and cores is not None and not (
            0 <= core_index < cores):
        raise PallasError(
            f"pl.semaphore_signal(core_index={core_index}) but the kernel's mesh has {cores} "
            f"cores. Fix: pass a core index in range({cores}).")
    return value


def semaphore_wait(sem: Any, value: Any = 1, *, decrement: bool = True) -> None:
    """Blocks until the semaphore reaches ``value``; then subtracts it (if ``decrement``)."""
    ref, flat, tree = _semaphore_access(sem, "semaphore_wait")
    semaphore_wait_p.bind(ref, *flat, _int32_operand(value, "value", "semaphore_wait"),
                          tree=tree, decrement=decrement)


def semaphore_read(sem: Any) -> jax.Array:
    """The current value of a semaphore."""
    ref, flat, tree = _semaphore_access(sem, "semaphore_read")
    return semaphore_read_p.bind(ref, *flat, tree=tree)  # type: ignore[no-any-return]


# --- scoped allocation ---------------------------------------------------------------------

run_scoped_p = _jax.Primitive("run_scoped")
run_scoped_p.multiple_results = True


@run_scoped_p.def_effectful_abstract_eval
def _run_scoped_abstract_eval(*refs: Any, jaxpr: Any, scoped: tuple[MemoryRef, ...],
                              collective_axes: tuple[Any, ...] = ()) -> Any:
    effects = _jax.input_effects_by_position(jaxpr.jaxpr, len(refs))
    # It allocates Refs of its own: discharge must reach it even when it touches no outer Ref.
    effects.add(_jax.internal_mutable_array_effect)
    return [v.aval for v in jaxpr.jaxpr.outvars], effects


def scratch_aval(ty: Any) -> Any:
    """The Ref aval of a scratch description (``MemoryRef``, ``ShapeDtypeStruct``, or an object
    with a ``memory_ref()`` method, such as a backend's semaphore type)."""
    if callable(getattr(ty, "memory_ref", None)):
        ty = ty.memory_ref()
    if isinstance(ty, MemoryRef):
        return _jax.make_ref_aval(ty.shape, ty.dtype, ty.memory_space)
    if hasattr(ty, "shape") and hasattr(ty, "dtype"):
        return _jax.make_ref_aval(ty.shape, ty.dtype, None)
    raise KernelSignatureError(
        f"A scratch buffer must be described by a memory space call such as "
        f"pl.ANY((8, 128), jnp.float32) or a jax.ShapeDtypeStruct; found {ty!r}."
    )


get_global_p = _jax.Primitive("get_global")
# A primitive whose result is a Ref it allocates (JAX's tracing and discharge treat it so).
get_global_p.ref_primitive = True  # type: ignore[attr-defined]
get_global_p.ref_allocating = True  # type: ignore[attr-defined]


@get_global_p.def_effectful_abstract_eval
def _get_global_abstract_eval(*, what: Any) -> Any:
    return what, {_jax.internal_mutable_array_effect}


def get_global(what: Any) -> Any:
    """A Ref that the whole launch of the kernel shares (every block and every grid point see
    the same one), zero when the kernel starts, as JAX's ``pl.get_global``: ``what`` is a
    backend's scratch type, e.g. ``plgpu.SemaphoreType.REGULAR``. Each call returns a Ref of
    its own. Backends that do not support it refuse it when lowering (Mosaic GPU supports
    semaphores); the interpreter refuses it (its blocks run one after another, so blocks
    that wait for each other's signals on it would hang or see too few)."""
    _current_grid("get_global")
    return get_global_p.bind(what=scratch_aval(what))


def _as_memory_ref(ty: Any) -> MemoryRef:
    if callable(getattr(ty, "memory_ref", None)):
        ty = ty.memory_ref()
    if isinstance(ty, MemoryRef):
        return ty
    scratch_aval(ty)  # validates
    return MemoryRef(tuple(ty.shape), jnp.dtype(ty.dtype), None)


def _collective_axes(collective_axes: Any) -> tuple[Any, ...]:
    """``run_scoped``'s ``collective_axes`` as a tuple, each an axis of the kernel's mesh."""
    if collective_axes in ((), None):
        return ()
    axes = tuple(collective_axes) if isinstance(collective_axes, (tuple, list)) else \
        (collective_axes,)
    ctx = _TRACE_CONTEXT.get()
    names = tuple(ctx.grid_names or ()) if ctx is not None else ()
    missing = [a for a in axes if a not in names]
    if missing:
        raise UnsupportedError(
            f"pl.run_scoped(collective_axes={collective_axes!r}): {missing} are not mesh axes "
            f"of this kernel (its named axes are {list(names)}); one buffer shared by the "
            "instances along an axis needs a kernel over a named mesh (pl.kernel, "
            "plgpu.kernel). Fix: allocate per instance (no collective_axes), or name an axis "
            "of the kernel's mesh.")
    return axes


def run_scoped(f: Callable[..., Any], *types: Any, collective_axes: Any = (),
               **kw_types: Any) -> Any:
    """Calls ``f`` with freshly allocated Refs described by ``types``; returns ``f``'s result.

    The Refs live only for the duration of the call. ``collective_axes`` names mesh axes of
    the kernel (``pl.kernel``/``plgpu.kernel`` axis names) along which the instances share one
    allocation (JAX's meaning): it is recorded on the equation for the backend, which refuses
    what it cannot share (Mosaic GPU shares SMEM among the warpgroups of a block, its thread
    axis). Naming an axis the kernel does not have raises ``UnsupportedError``.
    """
    axes = _collective_axes(collective_axes)
    flat_types, types_tree = jax.tree_util.tree_flatten((types, kw_types))
    scoped = tuple(_as_memory_ref(t) for t in flat_types)
    avals = [scratch_aval(t) for t in scoped]
    out_tree_box: list[Any] = []

    def flat_body(*refs: Any) -> list[Any]:
        args, kwargs = jax.tree_util.tree_unflatten(types_tree, refs)
        out = f(*args, **kwargs)
        leaves, tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(tree)
        return leaves

    ctx = _TRACE_CONTEXT.get()
    axis_sizes: tuple[tuple[str, int], ...] = ()
    if ctx is not None and ctx.grid_names is not None:
        axis_sizes = tuple(zip(ctx.grid_names, ctx.grid))
    jaxpr, _, consts = _jax.trace_to_jaxpr(flat_body, avals, name="run_scoped",
                                           axis_sizes=axis_sizes)
    # Closed-over values (outer Refs included) become leading operands.
    jaxpr = _jax.convert_constvars(jaxpr)
    outs = run_scoped_p.bind(*consts, jaxpr=_jax.ClosedJaxpr(jaxpr, ()), scoped=scoped,
                             collective_axes=axes)
    return jax.tree_util.tree_unflatten(out_tree_box[0], outs)


# --- control flow helpers ------------------------------------------------------------------


def when(condition: Any) -> Callable[[Callable[[], None]], None]:
    """Decorator: runs the decorated function only where ``condition`` holds."""

    def decorator(f: Callable[[], None]) -> None:
        if isinstance(condition, bool):
            if condition:
                f()
        else:
            lax.cond(condition, f, lambda: None)

    return decorator


def loop(lower: Any, upper: Any, *, init_carry: Any = None, step: Any = 1,
         unroll: int | bool | None = None) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: runs the body for ``i`` in ``range(lower, upper, step)``.

    Without ``init_carry`` the body is ``body(i)``; with it, ``body(i, carry) -> carry`` and
    the decorator returns the final carry.
    """
    for what, v in (("lower", lower), ("upper", upper), ("step", step)):
        dtype = getattr(v, "dtype", None)
        if isinstance(v, (float, bool)) or (dtype is not None
                                            and not jnp.issubdtype(dtype, jnp.integer)):
            raise PallasError(f"pl.loop needs integer bounds and step; {what}={v!r}. Fix: "
                              "use ints or integer arrays.")
    if isinstance(step, int) and step == 0:
        raise PallasError("pl.loop(step=0) would never end. Fix: use a non-zero step.")
    num = _trip_count(upper - lower, step)

    def decorator(body: Callable[..., Any]) -> Any:
        if init_carry is None:
            def fn(k: Any, carry: Any) -> Any:
                body(lower + k * step)
                return carry
        else:
            def fn(k: Any, carry: Any) -> Any:
                return body(lower + k * step, carry)
        return lax.fori_loop(0, num, fn, init_carry, unroll=unroll)

    return decorator


def _trip_count(span: Any, step: Any) -> Any:
    """``len(range(0, span, step))``: a ceiling division that also holds for negative steps
    (``pl.cdiv`` does not), with truncating divisions only on traced values."""
    if _jax.is_dim(span) and _jax.is_dim(step):
        return max(0, -(-span // step))
    if _jax.is_dim(step):
        return lax.div(span + step - (1 if step > 0 else -1), step)
    return jnp.where(step > 0, lax.div(span + step - 1, step), lax.div(span + step + 1, step))


def empty(shape: Sequence[int], dtype: Any, *, out_sharding: Any = None) -> jax.Array:
    """An array whose contents are unspecified (for out-of-kernel placeholders)."""
    return lax.empty(tuple(shape), dtype, out_sharding=out_sharding)


def empty_like(x: Any) -> Any:
    """A pytree like ``x`` (leaves with ``shape``/``dtype``) of unspecified contents."""
    return jax.tree_util.tree_map(lambda leaf: empty(leaf.shape, leaf.dtype), x)


def broadcast_to(a: Any, shape: Sequence[int]) -> jax.Array:
    """Broadcasts ``a`` to ``shape`` (as ``jnp.broadcast_to``)."""
    return jnp.broadcast_to(a, tuple(shape))
