"""Multi-GPU primitives of the Mosaic GPU backend, each with reference semantics for the
interpreter (under ``jax.shard_map``, every device running the kernel).

* ``multimem_store(source, ref, collective_axes)``: stores ``source`` into ``ref`` on every
  device along ``collective_axes`` (NVLink multicast, ``multimem.st``);
* ``multimem_load_reduce(ref, collective_axes=, reduction_op=)``: the elementwise reduction
  (``add``, ``min``, ``max``, ``and``, ``or``, ``xor``) of ``ref`` over every device along
  ``collective_axes`` (``multimem.ld_reduce``); give its result a layout right away with
  ``plgpu.layout_cast`` (as JAX asks);
* ``semaphore_signal_multicast(sem, value=1, collective_axes=)``: adds ``value`` to ``sem`` on
  every device along ``collective_axes``;
* ``remote_ref(ref, device_id)``: the same GMEM buffer on another device (the core's peer
  view), for TMA copies, reads, writes and semaphore signals; the interpreter refuses it.

``collective_axes`` must name every axis of the ``shard_map`` mesh, as JAX's lowering asks.
Semaphores (``plgpu.SemaphoreType.REGULAR``) live in global memory, one set per thread block,
zero when the kernel starts.

Reference semantics: each is a collective of the devices (``pallas_core.semantics``:
``gather_devices``): a store lands on every device, in the order of the devices' indices; a
reduction reads every device's buffer at the view the reading device names; a multicast
signal adds every device's value to the semaphore its view names on every device. So every
device must reach them in the same order and equally often, as the SPMD kernels that use
them do. A kernel's blocks run one after another in the interpreter, so a block waiting for
a count the other blocks of its own device would reach later is reported as a deadlock
(checked mode) rather than run.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_core import backend as plb
from pallas_core.backend import PallasError

REDUCTIONS = ("add", "min", "max", "and", "or", "xor")


def _axes(collective_axes: Hashable | tuple[Hashable, ...]) -> tuple[Any, ...]:
    return tuple(collective_axes) if isinstance(collective_axes, (tuple, list)) else \
        (collective_axes,)


def _primitive(name: str, results: bool) -> Any:
    p = plb.Primitive(name)
    p.multiple_results = not results
    return p


multimem_store_p = _primitive("gpu_multimem_store", results=False)
multimem_load_reduce_p = _primitive("gpu_multimem_load_reduce", results=True)
semaphore_signal_multicast_p = _primitive("gpu_semaphore_signal_multicast", results=False)


def _write_effects(*avals: Any, **_: Any) -> Any:
    return [], {plb.ReadEffect(0), plb.WriteEffect(0)}


multimem_store_p.def_effectful_abstract_eval(_write_effects)
semaphore_signal_multicast_p.def_effectful_abstract_eval(_write_effects)


@multimem_load_reduce_p.def_effectful_abstract_eval
def _load_reduce_abstract_eval(ref: Any, *flat: Any, tree: Any, **_: Any) -> Any:
    transforms = jax.tree_util.tree_unflatten(tree, flat)
    aval = plb.shape_after_transforms(ref, transforms)
    return plb.ShapedArray(aval.shape, aval.dtype), {plb.ReadEffect(0)}


def _view(ref: Any, fn: str) -> tuple[Any, list[Any], Any, Any]:
    base, transforms = plb.ref_and_transforms(ref, None, fn)
    flat, tree = jax.tree_util.tree_flatten(transforms)
    aval = plb.shape_after_transforms(plb.ref_type_of(base), transforms)
    return base, flat, tree, aval


def multimem_store(source: Any, ref: Any, collective_axes: Hashable | tuple[Hashable, ...]
                   ) -> None:
    """Stores ``source`` into ``ref`` (a GMEM Ref, or a view of one) on every device along
    ``collective_axes`` (all axes of the ``shard_map`` mesh)."""
    base, flat, tree, aval = _view(ref, "multimem_store")
    source = jnp.asarray(source)
    if source.shape != tuple(aval.shape) or source.dtype != aval.dtype:
        raise PallasError(f"plgpu.multimem_store: the source {source.dtype}"
                          f"{list(source.shape)} does not fit the Ref's view "
                          f"{aval.dtype}{list(aval.shape)}. Fix: slice the Ref to match.")
    multimem_store_p.bind(base, *flat, source, tree=tree,
                          collective_axes=_axes(collective_axes))


def multimem_load_reduce(ref: Any, *, collective_axes: Hashable | tuple[Hashable, ...],
                         reduction_op: str) -> jax.Array:
    """The ``reduction_op`` (one of :data:`REDUCTIONS`) of ``ref`` (a GMEM Ref or a view of
    one) over every device along ``collective_axes``; apply ``plgpu.layout_cast`` to it
    at once."""
    if reduction_op not in REDUCTIONS:
        raise PallasError(f"plgpu.multimem_load_reduce(reduction_op={reduction_op!r}): expected "
                          f"one of {REDUCTIONS}.")
    base, flat, tree, aval = _view(ref, "multimem_load_reduce")
    if reduction_op in ("and", "or", "xor") and not jnp.issubdtype(aval.dtype, jnp.integer):
        raise PallasError(f"plgpu.multimem_load_reduce: reduction {reduction_op!r} needs an "
                          f"integer Ref, found {aval.dtype}.")
    return multimem_load_reduce_p.bind(  # type: ignore[no-any-return]
        base, *flat, tree=tree, collective_axes=_axes(collective_axes),
        reduction_op=reduction_op)


def semaphore_signal_multicast(semaphore: Any, value: Any = 1, *,
                               collective_axes: Hashable | tuple[Hashable, ...]) -> None:
    """Adds ``value`` to ``semaphore`` on every device along ``collective_axes``."""
    base, flat, tree, aval = _view(semaphore, "semaphore_signal_multicast")
    if aval.shape != () or aval.dtype != jnp.int32:
        raise PallasError("plgpu.semaphore_signal_multicast needs one semaphore (an int32 Ref "
                          f"of shape (); index an array of them with .at[i]), found "
                          f"{aval.dtype}{list(aval.shape)}.")
    semaphore_signal_multicast_p.bind(base, *flat, jnp.asarray(value, jnp.int32), tree=tree,
                                      collective_axes=_axes(collective_axes))


def remote_ref(ref: Any, device_id: Any, device_id_type: Any = None) -> Any:
    """``ref`` (a GMEM Ref or a view of one) as the same symmetric buffer on device
    ``device_id`` of the ``shard_map`` mesh (mesh coordinates, or one index with
    ``device_id_type=pl.DeviceIdType.LOGICAL``): TMA copies and semaphore signals through it
    reach that device's memory. The interpreter refuses reads, writes and copies through
    it."""
    from pallas_core.backend import DeviceIdType

    return plb.remote_view(ref, device_id, device_id_type or DeviceIdType.MESH)


class RefView:
    """A view of the Ref ``self.ref`` that only some operations take (``plgpu.multicast_ref``,
    ``plgpu.cluster_ref``): its shape and dtype are the Ref's, and ``view.at[idx]`` is the same
    kind of view of ``ref.at[idx]`` (``_rewrap``)."""

    ref: Any

    def _rewrap(self, ref: Any) -> RefView:
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the view."""
        return tuple(self.ref.shape)

    @property
    def dtype(self) -> Any:
        """The dtype of the view."""
        return self.ref.dtype

    @property
    def at(self) -> Any:
        """``view.at[idx]``: the same kind of view of ``ref.at[idx]``."""
        outer = self

        class _At:
            def __getitem__(self, idx: Any) -> RefView:
                return outer._rewrap(outer.ref.at[idx])

        return _At()


class MulticastRef(RefView):
    """``plgpu.multicast_ref(ref, collective_axes)``: ``ref`` (a GMEM Ref or a view of one) on
    every device along ``collective_axes`` at once. ``copy_smem_to_gmem(src,
    multicast_ref(dst, axes))`` writes ``src`` into ``dst`` on all of them (as
    ``multimem_store(src[...], dst, axes)``, so the data has landed on return); ``.at[...]``
    narrows the view. Reads and writes through it are refused, as in JAX."""

    def __init__(self, ref: Any, collective_axes: tuple[Any, ...]) -> None:
        self.ref = ref
        self.collective_axes = collective_axes

    def _rewrap(self, ref: Any) -> MulticastRef:
        return MulticastRef(ref, self.collective_axes)

    def _refuse(self, *_: Any) -> Any:
        raise PallasError("a read or write through plgpu.multicast_ref: only "
                          "plgpu.copy_smem_to_gmem takes a multicast view (as in JAX). Fix: "
                          "copy into it, or use plgpu.multimem_store / multimem_load_reduce.")

    __getitem__ = __setitem__ = _refuse

    def __repr__(self) -> str:
        return f"plgpu.multicast_ref({self.ref!r}, {self.collective_axes!r})"


def multicast_ref(ref: Any, collective_axes: Hashable | tuple[Hashable, ...]) -> MulticastRef:
    """``ref`` (a GMEM Ref or a view of one) on every device along ``collective_axes`` (all
    axes of the ``shard_map`` mesh) at once, for ``copy_smem_to_gmem`` (see
    :class:`MulticastRef`)."""
    _view(ref, "multicast_ref")  # a GMEM Ref, or a view of one, not of another device's
    if any(isinstance(t, plb.PeerRefTransform) for t in getattr(ref, "transforms", ())):
        raise PallasError("plgpu.multicast_ref of a plgpu.remote_ref view (another device's "
                          "buffer). Fix: make the multicast view of the Ref itself.")
    return MulticastRef(ref, _axes(collective_axes))


# --- reference semantics ---------------------------------------------------------------------


def _devices(collective_axes: tuple[Any, ...], what: str) -> int:
    axes = plb.device_axes(what)
    if set(collective_axes) != {n for n, _ in axes}:
        raise PallasError(f"{what}(collective_axes={collective_axes}) must name every axis of "
                          f"the shard_map mesh {tuple(n for n, _ in axes)}, as Mosaic GPU's "
                          "multicast reaches every device of it.")
    n = 1
    for _, size in axes:
        n *= size
    return n


def _from_every_device(ref: Any, args: Sequence[Any], tree: Any, n: int,
                       update: Callable[[Any, Any], Any]) -> Any:
    """The discharge of a write every device sends to this one (``args``: the view's flat
    indexers, then the value): each of the ``n`` devices' ``(value, view)``, in the order of
    their indices, updates ``ref`` at its view by ``update(old, value)``."""
    flat, value = list(args[:tree.num_leaves]), args[tree.num_leaves]
    sent = plb.gather_devices((value, flat))

    def one(d: Any, x: Any) -> Any:
        v, f = jax.tree_util.tree_map(lambda a: a[d], sent)
        return plb.read_modify_write(x, f, tree, lambda old: update(old, v))[1]

    new = lax.fori_loop(0, n, one, ref)
    return (new,) + (None,) * len(args), []


def _store_discharge(in_avals: Any, out_avals: Any, ref: Any, *args: Any, tree: Any,
                     collective_axes: tuple[Any, ...]) -> Any:
    n = _devices(collective_axes, "plgpu.multimem_store")
    return _from_every_device(ref, args, tree, n, lambda old, v: v.astype(old.dtype))


_COMBINE: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda a, b: a + b, "min": jnp.minimum, "max": jnp.maximum, "and": jnp.bitwise_and,
    "or": jnp.bitwise_or, "xor": jnp.bitwise_xor}


def _load_reduce_discharge(in_avals: Any, out_avals: Any, ref: Any, *flat: Any, tree: Any,
                           collective_axes: tuple[Any, ...], reduction_op: str) -> Any:
    n = _devices(collective_axes, "plgpu.multimem_load_reduce")
    everyone = plb.gather_devices(ref)
    views = [plb.read_modify_write(everyone[d], flat, tree, lambda old: old)[0]
             for d in range(n)]
    acc = views[0]
    if jnp.issubdtype(acc.dtype, jnp.floating) and reduction_op == "add":
        total = views[0].astype(jnp.float32)
        for v in views[1:]:
            total = total + v.astype(jnp.float32)
        out = total.astype(acc.dtype)
    else:
        for v in views[1:]:
            acc = _COMBINE[reduction_op](acc, v)
        out = acc
    return (None,) * (1 + len(flat)), out


def _signal_discharge(in_avals: Any, out_avals: Any, sem: Any, *args: Any, tree: Any,
                      collective_axes: tuple[Any, ...]) -> Any:
    n = _devices(collective_axes, "plgpu.semaphore_signal_multicast")
    return _from_every_device(sem, args, tree, n, lambda old, v: old + v)


SEMANTICS: tuple[plb.PrimitiveSemantics, ...] = (
    plb.PrimitiveSemantics(multimem_store_p, discharge=_store_discharge),
    plb.PrimitiveSemantics(multimem_load_reduce_p, discharge=_load_reduce_discharge),
    plb.PrimitiveSemantics(semaphore_signal_multicast_p, discharge=_signal_discharge),
)
