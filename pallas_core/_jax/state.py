"""Refs and their state primitives: Ref avals and effects, indexers and views (reshape,
bitcast, a peer device's buffer), JAX's refusals of a store read back as data, and the
discharge of stateful jaxprs, with JAX's discharge rules of ``get``/``swap`` extended
(views that reshape, remote views refused) and adapted across JAX releases."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import core
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing as state_indexing
from jax._src.state import primitives as state_primitives
from jax._src.state import types as state_types

from pallas_core._jax.base import ClosedJaxpr, Jaxpr, Primitive

AbstractRef = state_types.AbstractRef
ReadEffect = state_types.ReadEffect
WriteEffect = state_types.WriteEffect


internal_mutable_array_effect = core.internal_mutable_array_effect


def is_ref_effect(effect: Any) -> bool:
    """Whether ``effect`` is a read, write or accumulation of a Ref (not an outside effect)."""
    return isinstance(effect, state_types.RefEffect)

NDIndexer: type[Any] = state_indexing.NDIndexer  # abstract in JAX 0.12's annotations
BitcastTransform = state_types.BitcastTransform
"""``ref.bitcast(dtype)``: a view of a Ref's bits as another dtype."""
ReshapeTransform = state_types.ReshapeTransform
"""``ref.reshape(*shape)``: a view of a Ref in another shape."""
Slice = state_indexing.Slice
ds = state_indexing.ds
get_p = state_primitives.get_p
swap_p = state_primitives.swap_p
addupdate_p = state_primitives.addupdate_p
"""``ref[idx] += value`` (what a Ref's ``+=`` becomes)."""
broadcast_to_p = state_primitives.broadcast_to_p
"""JAX's equal-rank broadcast, which indexing a Ref with several index arrays binds."""
get_ref_and_transforms = state_primitives.get_ref_and_transforms
_UNVALIDATED = threading.Lock()


def get_ref_and_transforms_past_the_end(ref: Any, idx: Any, fn: str) -> tuple[Any, Any]:
    """:func:`get_ref_and_transforms` for a masked access, whose static slices may run past the
    Ref's end (the mask keeps the lanes past it from being touched, as Triton's masked loads
    and JAX's Triton kernels rely on). JAX checks static slices when it builds the indexer
    (JAX 0.10 skipped a start of 0; 0.11 on check it too): here the check is skipped."""
    try:
        return get_ref_and_transforms(ref, idx, fn)  # type: ignore[no-any-return]
    except ValueError as e:
        if not out_of_bound_slice(e):
            raise
        refused = e
    indexer = state_indexing.NDIndexer
    checked = indexer.__post_init__

    def unchecked(self: Any) -> None:
        object.__setattr__(self, "validate", False)
        checked(self)

    with _UNVALIDATED:
        indexer.__post_init__ = unchecked  # type: ignore[method-assign]
        try:
            found, transforms = get_ref_and_transforms(ref, idx, fn)
        finally:
            indexer.__post_init__ = checked  # type: ignore[method-assign]
    last = transforms[-1] if transforms else None
    if isinstance(last, indexer):  # a start past the end is refused still
        for i, size in zip(last.indices, last.shape):
            start = core.to_concrete_value(i.start) if isinstance(i, Slice) else None
            if start is not None and isinstance(size, int) and start >= size:
                raise refused
    return found, transforms
transform_array = state_discharge.transform_array
transform_swap_array = state_discharge.transform_swap_array
run_state = state_discharge.run_state
run_state_p = state_discharge.run_state_p


def out_of_bound_slice(error: BaseException) -> bool:
    """Whether ``error`` is JAX's own refusal of a static slice past a Ref's end (raised while
    the Ref is indexed)."""
    return isinstance(error, ValueError) and str(error).startswith("Out of bound slice")


@dataclasses.dataclass(frozen=True)
class StoreMismatch:
    """What JAX's refusal of a Ref store (``ref[...] = value``, ``ref[...] += value``) found:
    ``kind`` is ``"dtype"`` or ``"shape"``; ``expected`` is the Ref's (or the view's) and
    ``found`` the value's, as JAX prints them (``int32``, ``(16, 128)``), or ``None`` where
    its message does not say."""

    kind: str
    expected: str | None
    found: str | None


_STORE_REFUSED = re.compile(r"Invalid (dtype|shape) for `(?:swap|addupdate)`")
_STORE_PARTS = {
    # What JAX 0.10 to 0.12 print, first found first: the shape of the view stored into (a
    # Ref's own where there is no view); ``addupdate`` prints its value's dtype as a shape.
    "dtype": ((r"Ref dtype: ([^\s.]+)",), (r"Value (?:dtype|shape): ([^\s.]+)",)),
    "shape": ((r"Expected shape: (\([^)]*\))", r"Ref shape: (\([^)]*\))"),
              (r"Value shape: (\([^)]*\))",)),
}


def store_mismatch(error: BaseException) -> StoreMismatch | None:
    """The mismatch of dtype or shape for which JAX refused to store a value into a Ref
    while a kernel was traced, or ``None`` where ``error`` is something else."""
    if not isinstance(error, ValueError):
        return None
    text = str(error)
    refused = _STORE_REFUSED.search(text)
    if refused is None:
        return None
    kind = refused.group(1)

    def first(patterns: Sequence[str]) -> str | None:
        found = (re.search(p, text) for p in patterns)
        return next((m.group(1) for m in found if m is not None), None)

    expected, found = (first(p) for p in _STORE_PARTS[kind])
    return StoreMismatch(kind, expected, found)


def _plain_memory_space(x: Any) -> Any:
    """``x`` as a value in the default memory space when its type carries a backend's own
    memory space. JAX 0.12's ``run_state`` discharges a Ref into a value that keeps the Ref's
    memory space, and every ``lax`` primitive then refuses a memory space that is not one of
    JAX's (a Mosaic GPU ``SMEM`` operand read by a ``wgmma`` under ``pl.run_state``)."""
    aval = core.typeof(x) if isinstance(x, core.Tracer) else None
    space = getattr(aval, "memory_space", None)
    if (not isinstance(aval, core.ShapedArray) or space is None
            or isinstance(space, getattr(core, "MemorySpace", ()))):
        return x
    return state_primitives.with_memory_space_constraint(x, core.MemorySpace.Device)


def register_discharge_rule(prim: Primitive) -> Callable[[Callable[..., Any]], Any]:
    """Decorator registering ``rule(in_avals, out_avals, *args, **params)`` for ``prim``.

    The rule returns ``(new values of Ref operands or None, outputs)``. JAX 0.11 passes a
    context object in place of the two aval lists; this adapts it.
    """
    def register(rule: Callable[..., Any]) -> Any:
        if hasattr(state_discharge, "DischargeContext"):
            def adapted(ctx: Any, *args: Any, **params: Any) -> Any:
                return rule(ctx.in_avals, ctx.out_avals, *map(_plain_memory_space, args),
                            **params)
            state_discharge.register_discharge_rule(prim)(adapted)
        else:
            state_discharge.register_discharge_rule(prim)(rule)
        return rule
    return register


_JAX_SWAP_DISCHARGE = state_discharge._discharge_rules[state_primitives.swap_p]
_JAX_GET_DISCHARGE = state_discharge._discharge_rules[state_primitives.get_p]


def apply_leading_reshapes(x: Any, transforms: Sequence[Any]) -> tuple[Any, list[Any]]:
    """``(y, rest)``: ``x`` reshaped by the ``ref.reshape(...)`` transforms that lead
    ``transforms`` (a view ``ref.reshape(...).at[...]``), and the transforms after them.

    JAX 0.10's ``transform_swap_array`` cannot write back through a reshape, so a discharge
    that writes a view applies the leading reshapes here, indexes ``y`` with ``rest``, and
    reshapes the written ``y`` back to ``x.shape``."""
    rest = list(transforms)
    y = x
    while rest and isinstance(rest[0], ReshapeTransform):
        y = y.reshape(tuple(rest.pop(0).shape))
    return y, rest


def _swap_discharge(*args: Any, tree: Any) -> Any:
    """JAX's discharge of ``ref[...] = val`` (its rule, whichever its signature), also for
    views that reshape the Ref before indexing it (``ref.reshape(...).at[...]``), which JAX
    0.10's ``transform_swap_array`` indexes in the Ref's own shape: the leading reshapes are
    applied here (``apply_leading_reshapes``), and the written array reshaped back. Remote
    views are refused."""
    n = tree.num_leaves
    x, val, idx = args[-n - 2], args[-n - 1], args[len(args) - n:]
    transforms = list(jax.tree_util.tree_unflatten(tree, idx))
    _refuse_peer_views(transforms)
    if not (len(transforms) > 1 and isinstance(transforms[0], ReshapeTransform)):
        return _JAX_SWAP_DISCHARGE(*args, tree=tree)
    y, rest = apply_leading_reshapes(x, transforms)
    old, y_new = state_discharge.transform_swap_array(y, rest, val)
    return (y_new.reshape(x.shape), None) + (None,) * n, old


def _get_discharge(*args: Any, tree: Any) -> Any:
    """JAX's discharge of ``ref[...]`` (its rule), refusing remote views."""
    n = tree.num_leaves
    _refuse_peer_views(jax.tree_util.tree_unflatten(tree, args[len(args) - n:]))
    return _JAX_GET_DISCHARGE(*args, tree=tree)


state_discharge.register_discharge_rule(state_primitives.swap_p)(_swap_discharge)
state_discharge.register_discharge_rule(state_primitives.get_p)(_get_discharge)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PeerRefTransform(state_types.Transform):  # type: ignore[misc]
    """The view of a Ref as the same (symmetric) buffer on another device of the
    ``shard_map`` mesh: ``device_id`` (int32 scalars: mesh coordinates, or one logical index
    when ``mesh_coordinates`` is False). It keeps the shape and dtype; indexers applied after
    it index the peer's buffer alike."""

    device_id: tuple[Any, ...]
    mesh_coordinates: bool = dataclasses.field(default=True, metadata=dict(static=True))

    def transform_type(self, x: Any) -> Any:
        return x

    def transform_shape(self, shape: Any) -> Any:
        return shape

    def transform_dtype(self, dtype: Any) -> Any:
        return dtype

    def undo(self, x: Any) -> Any:
        raise NotImplementedError("a peer view cannot be undone")

    def commute_ndindexer(self, _: Any, indexer: Any) -> tuple[Any, Any]:
        return indexer, self


def peer_view(ref: Any, device_id: Sequence[Any], mesh_coordinates: bool) -> Any:
    """``ref`` (a Ref or a view of one) as the same buffer on another device."""
    if isinstance(ref, state_types.TransformedRef):
        base, transforms = ref.ref, tuple(ref.transforms)
    else:
        base, transforms = ref, ()
    return state_types.TransformedRef(
        base, (*transforms, PeerRefTransform(  # type: ignore[abstract]
            tuple(device_id), mesh_coordinates)))


def _refuse_peer_views(transforms: Sequence[Any]) -> None:
    if any(isinstance(t, PeerRefTransform) for t in transforms):
        from pallas_core.errors import UnsupportedError

        raise UnsupportedError(
            "reading or writing another device's memory through a remote view "
            "(plgpu.remote_ref) is not supported by the interpreter. Fix: lower the kernel for "
            "its hardware, or exchange the data with collectives (jax.lax.all_gather under "
            "shard_map).")


def ref_type_of(ref: Any) -> Any:
    """The abstract value of a Ref or a view of one."""
    return core.typeof(ref)


def shape_after_transforms(ref_aval: Any, transforms: Sequence[Any]) -> Any:
    """The ShapedArray read from a Ref after applying ``transforms``."""
    return state_types.transform_type(transforms, ref_aval.inner_aval)


def make_ref_aval(shape: Sequence[int], dtype: Any, memory_space: Any = None) -> Any:
    """A Ref aval of the given shape and dtype."""
    return AbstractRef(core.ShapedArray(tuple(shape), dtype), memory_space=memory_space)


def register_initial_ref(cls: type, to_aval: Callable[[Any], tuple[Any, Any]]) -> None:
    """Values of ``cls`` given to ``run_state`` start a Ref of their own kind: ``to_aval(x)``
    returns the Ref's aval and its initial value (a backend's accumulator types)."""
    state_types._ref_type_aval_mappings[cls] = to_aval


def discharge_state(closed_jaxpr: ClosedJaxpr, *,
                    axis_sizes: Sequence[tuple[str, int]] = ()) -> ClosedJaxpr:
    """The pure form of a stateful closed jaxpr: Ref inputs become values, final Ref values
    are appended to the outputs.

    Discharging re-traces the jaxpr, so the named axes a kernel body uses
    (``lax.axis_index`` under ``pl.kernel``) must be given in ``axis_sizes``.
    """
    with core.extend_axis_env_nd(list(axis_sizes)):
        if _DISCHARGE_STRIPS_MEMORY_SPACE:
            # JAX 0.11 keeps a Ref's memory space on its discharged value unless told not to;
            # the values here are plain arrays (memory spaces are the backends' business).
            return state_discharge.discharge_state(  # type: ignore[call-arg]
                closed_jaxpr, strip_memory_space=True)
        return state_discharge.discharge_state(closed_jaxpr)


_DISCHARGE_STRIPS_MEMORY_SPACE = (
    "strip_memory_space" in inspect.signature(state_discharge.discharge_state).parameters)


@contextlib.contextmanager
def discharge_rules_wrapped(
    wrap: Callable[[Primitive, Callable[..., Any]], Callable[..., Any]],
    prims: Sequence[Primitive],
) -> Any:
    """Within the block, the discharge rule of each of ``prims`` is ``wrap(prim, rule)``.

    ``rule`` and the wrapped rule use the ``(in_avals, out_avals, *args, **params)`` form of
    :func:`register_discharge_rule`. Used by the interpreter's checked mode to add checks
    around JAX's own rules for reads and writes.
    """
    with _RULES_LOCK:
        saved = {p: state_discharge._discharge_rules[p] for p in prims}
        try:
            for p, original in saved.items():
                plain = _plain_rule(original)
                register_discharge_rule(p)(wrap(p, plain))
            yield
        finally:
            state_discharge._discharge_rules.update(saved)


_RULES_LOCK = threading.RLock()


def _plain_rule(rule: Callable[..., Any]) -> Callable[..., Any]:
    if not hasattr(state_discharge, "DischargeContext"):
        return rule

    def plain(in_avals: Any, out_avals: Any, *args: Any, **params: Any) -> Any:
        ctx = state_discharge.DischargeContext(in_avals, out_avals,  # type: ignore[attr-defined]
                                               [True] * len(in_avals), True)
        return rule(ctx, *args, **params)
    return plain


def written_invars(jaxpr: Jaxpr) -> set[Any]:
    """The invars of ``jaxpr`` (Refs) that it writes or accumulates into, at any depth.

    From the jaxpr's effects, not its discharged form: a loop that only reads a Ref still
    carries it through, so discharge gives it a new variable although nothing changed.
    """
    return {eff.input for eff in jaxpr.effects
            if isinstance(eff, state_types.RefEffect) and not isinstance(eff, ReadEffect)}
