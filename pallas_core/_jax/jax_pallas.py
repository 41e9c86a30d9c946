"""What the installed JAX's own Pallas (``jax._src.pallas``) says, for the backends that agree
with it and the tests that compare with it: the Mosaic format and ops its TPU lowering
writes, the primitives its lowerings have rules for, its kernel primitives, and the backend
its ``CompilerParams`` classes belong to."""

from __future__ import annotations

import functools
import inspect
from typing import Any

from pallas_core._jax.base import Primitive


def mosaic_serde_version() -> int:
    """The Mosaic format version JAX writes into ``tpu_custom_call`` bodies when it cannot ask a
    TPU runtime which it reads (its forward-compatible version: 11 in JAX 0.10, 15 in 0.11)."""
    from jax._src import tpu_custom_call
    return int(getattr(tpu_custom_call, "_FWD_COMPAT_VERSION", 11))


@functools.cache
@functools.cache
def sparsecore_adds_only_into_shared_vmem() -> bool:
    """Whether JAX's own SparseCore lowering refuses an adding DMA (``add=True``) out of a
    vector subcore's VMEM into anything but ``VMEM_SHARED`` (JAX 0.12), rather than also
    lowering one into HBM (JAX 0.10). Reads the installed JAX's lowering."""
    try:
        from jax._src.pallas.mosaic import sc_lowering
    except ImportError:  # no SparseCore lowering in this JAX: nothing to follow
        return False
    return "supported when the destination is in VMEM_SHARED" in inspect.getsource(sc_lowering)


def mosaic_waits_name_both_ends() -> bool:
    """Whether JAX's own Pallas TPU lowering waits for a DMA with ``tpu.wait_dma`` (naming the
    copy's source and target, ``wait_target`` telling which side waits: JAX 0.12) rather than
    ``tpu.wait_dma2`` (one semaphore: JAX 0.10). Both ops exist in both jaxlibs; this reads
    which one the installed JAX's lowering emits."""
    from jax._src.pallas.mosaic import lowering as mosaic_lowering
    return "wait_dma2(" not in inspect.getsource(mosaic_lowering)


def jax_lowering_rule_names(backend: str) -> dict[str, frozenset[str]]:
    """The names of the primitives JAX's own Pallas lowering for ``backend`` has a rule for,
    per kernel type: what this project's backends are compared against. ``"mosaic_tpu"`` keys
    them by kernel type (``"tc"``, ``"sc_vector_subcore"``, ...); ``"triton"`` has one registry,
    under ``"triton"``; ``"mosaic_gpu"`` the union of its lowering semantics' registries, under
    ``"mosaic_gpu"``."""
    if backend == "mosaic_tpu":
        import jax.experimental.pallas.tpu
        from jax._src.pallas.mosaic import lowering as mosaic_lowering

        return {str(getattr(kind, "value", kind)): frozenset(p.name for p in rules)
                for kind, rules in mosaic_lowering.lowering_rules.items()}
    if backend == "mosaic_gpu":
        import jax.experimental.pallas.mosaic_gpu
        from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering

        return {"mosaic_gpu": frozenset(p.name for rules in
                                        mgpu_lowering.mosaic_lowering_rules.values()
                                        for p in rules)}
    if backend == "triton":
        import jax.experimental.pallas.triton  # noqa: F401 - registers its primitives' rules
        from jax._src.pallas.triton import lowering as triton_lowering

        return {"triton": frozenset(p.name for p in triton_lowering.triton_lowering_rules)}
    raise ValueError(f"no JAX rule registry known for {backend!r}")


def jax_mosaic_primitive(kind: str, name: str) -> Any:
    """JAX's own primitive named ``name`` that its Mosaic lowering has a rule for on kernels
    of ``kind`` (``"sc_vector_subcore"``, ...), or ``None``: for tests that compare a
    backend's module with JAX's for a primitive JAX does not export (the SparseCore's
    ``masked_cummin``)."""
    import jax.experimental.pallas.tpu
    import jax.experimental.pallas.tpu_sc  # noqa: F401 - registers the SparseCore rules
    from jax._src.pallas.mosaic import lowering as mosaic_lowering

    for k, rules in mosaic_lowering.lowering_rules.items():
        if str(getattr(k, "value", k)) == kind:
            return next((p for p in rules if p.name == name), None)
    return None


def jax_pallas_primitives() -> dict[str, Primitive]:
    """``jax.experimental.pallas``'s kernel primitives by name (``pallas_call``, ``core_map``,
    and ``mpmd_map`` where JAX has it)."""
    from jax._src.pallas import core as pallas_core_jax
    from jax._src.pallas import pallas_call as pallas_call_jax

    found: dict[str, Primitive] = {"pallas_call": pallas_call_jax.pallas_call_p}
    if hasattr(pallas_core_jax, "core_map_p"):  # JAX 0.10 (0.11 binds mpmd_map instead)
        found["core_map"] = pallas_core_jax.core_map_p
    try:  # pl.kernel binds mpmd_map
        from jax._src.pallas import mpmd
    except ImportError:
        return found
    return {**found, "mpmd_map": mpmd.mpmd_map_p}


_JAX_PARAMS_MODULES = {"jax._src.pallas.triton.core": "triton",
                       "jax._src.pallas.mosaic.core": "mosaic_tpu",
                       "jax._src.pallas.mosaic_gpu.core": "mosaic_gpu"}


def jax_params_backend(params: Any) -> str | None:
    """The backend ``jax.experimental.pallas``'s own ``CompilerParams`` object ``params``
    belongs to (``pltpu.CompilerParams``: ``"mosaic_tpu"``), by the module JAX defines its
    class in; ``None`` for any other object."""
    cls = type(params)
    if cls.__name__ != "CompilerParams":
        return None
    return _JAX_PARAMS_MODULES.get(cls.__module__)
