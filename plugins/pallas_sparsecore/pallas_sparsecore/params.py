"""The SparseCore backend's chips, meshes, memory spaces and compiler parameters."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from pallas_mosaic_tpu import params as _tpu_params

from pallas_core import Mesh
from pallas_core.backend import CompilerParams as _CompilerParams
from pallas_core.backend import PallasError

NAME = "sparsecore"

VMEM_SHARED = _tpu_params.VMEM_SHARED
"""The memory one SparseCore's subcores share (its SPMEM): ``pltpu.VMEM_SHARED``, as in JAX;
per-subcore memory is ``pltpu.VMEM`` (TileSPMEM), scalars live in ``pltpu.SMEM``."""


@dataclasses.dataclass(frozen=True)
class SparseCoreInfo:
    """What lowering needs to know about a chip's SparseCores."""

    num_cores: int
    """SparseCores per chip (per TensorCore-visible device)."""
    num_subcores: int
    """Vector subcores per SparseCore."""
    num_lanes: int
    """32-bit lanes of a vector register: the length of index vectors and sorted vectors."""
    vmem_capacity_bytes: int
    """Per-subcore VMEM."""
    dma_granule_size_bytes: int


_V5P = SparseCoreInfo(4, 16, 8, 512 * 1024, 32)
_V6E = SparseCoreInfo(2, 16, 8, 256 * 1024, 32)
_V7 = SparseCoreInfo(2, 16, 16, 512 * 1024, 32)
CHIPS: dict[str, SparseCoreInfo] = {
    "v5p": _V5P, "TPU v5p": _V5P, "TPU v5": _V5P,
    "v6e": _V6E, "TPU v6e": _V6E, "TPU v6 lite": _V6E,
    "v7": _V7, "TPU7": _V7, "v7x": _V7, "TPU7x": _V7,
    "TPU8i": SparseCoreInfo(1, 4, 16, 512 * 1024, 64),
    "TPU8t": SparseCoreInfo(2, 16, 16, 256 * 1024, 64),
}
"""Chips with SparseCores, by short name and JAX device kind."""
DEFAULT_TARGET = "v7x"
_NO_SPARSECORE = ("TPU v2", "TPU v3", "TPU v4", "TPU v4 lite", "TPU v5 lite", "TPU v5e", "v2",
                  "v3", "v4", "v5e")


def _ambient_device_kind() -> str | None:
    """The chip JAX would target: an abstract mesh's TPU device (``jax.sharding.
    use_abstract_mesh``, as JAX's SparseCore docs use on hosts without a TPU; not the CPU
    devices of a ``shard_map`` run here), else an attached TPU."""
    import jax

    try:
        mesh = jax.sharding.get_abstract_mesh()
        device = getattr(mesh, "abstract_device", None)
        kind = getattr(device, "device_kind", None)
        if kind and getattr(device, "platform", "tpu") == "tpu":
            return str(kind)
    except Exception:
        pass
    try:
        devices = jax.devices("tpu")
    except RuntimeError:
        return None
    return str(devices[0].device_kind) if devices else None


def get_sparse_core_info(target: str | None = None) -> SparseCoreInfo:
    """The SparseCore description of ``target`` (``"v5p"``, ``"v6e"``, ``"v7x"``, or a JAX
    device kind such as ``"TPU7x"``). Without one: the chip of an abstract mesh set with
    ``jax.sharding.use_abstract_mesh``, else the attached TPU, else ``"v7x"``. No TPU is
    needed."""
    kind = target if target is not None else (_ambient_device_kind() or DEFAULT_TARGET)
    if kind in CHIPS:
        return CHIPS[kind]
    if kind in _NO_SPARSECORE:
        raise PallasError(
            f"the chip {kind!r} has no SparseCores. Fix: target one that has (one of "
            f"{sorted(k for k in CHIPS if not k.startswith('TPU'))}).")
    raise PallasError(
        f"unknown SparseCore target {kind!r}. Fix: use one of {sorted(CHIPS)}.")


@dataclasses.dataclass(frozen=True)
class SCCompilerParams(_CompilerParams):
    """Compiler parameters of the SparseCore backend; passing them selects it.

    ``target``: the chip (see :func:`get_sparse_core_info`); ``kernel_type``: ``"vector"``
    or ``"scalar"`` subcores (set by the mesh); ``use_tc_tiling_on_sc`` and
    ``needs_layout_passes`` go to the runtime as JAX passes them; ``collective_id`` names
    the barrier semaphore of a kernel that uses ``pltpu.get_barrier_semaphore()``.
    """

    BACKEND: ClassVar[str] = NAME
    target: str | None = None
    kernel_type: str = "vector"
    use_tc_tiling_on_sc: bool | None = None
    needs_layout_passes: bool = True
    num_cores: int | None = None
    num_subcores: int | None = None
    collective_id: int | None = None

    def __post_init__(self) -> None:
        if self.kernel_type not in ("vector", "scalar"):
            raise PallasError(f"plsc.CompilerParams(kernel_type={self.kernel_type!r}): expected "
                              "'vector' or 'scalar'.")
        if self.target is not None:
            get_sparse_core_info(self.target)
        if self.collective_id is not None and (isinstance(self.collective_id, bool) or
                                               not isinstance(self.collective_id, int)):
            raise PallasError(f"plsc.CompilerParams(collective_id={self.collective_id!r}): "
                              "expected an int.")

    @property
    def info(self) -> SparseCoreInfo:
        return get_sparse_core_info(self.target)


CompilerParams = SCCompilerParams


def _count(value: Any, what: str, chip_max: int, chip: str, mesh: str) -> int:
    if value is None:
        return chip_max
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PallasError(f"plsc.{mesh}({what}={value!r}): expected a positive int.")
    if value > chip_max:
        raise PallasError(
            f"plsc.{mesh}({what}={value}) is larger than the chip: {chip} has {chip_max} "
            f"{what.removeprefix('num_')}. Fix: use {what}<={chip_max}, or target a larger chip "
            "(target=...).")
    return value


@dataclasses.dataclass(frozen=True)
class SubcoreMesh(Mesh):
    """A mesh of SparseCore subcores for ``pl.kernel``: built by :func:`VectorSubcoreMesh` or
    :func:`ScalarSubcoreMesh`; it carries the chip, which its kernels are lowered for."""

    kernel_type: str = "vector"
    target: str = DEFAULT_TARGET

    @property
    def info(self) -> SparseCoreInfo:
        return get_sparse_core_info(self.target)

    @property
    def num_cores(self) -> int:
        return self.axis_sizes[0]

    @property
    def num_subcores(self) -> int:
        return self.axis_sizes[1] if self.kernel_type == "vector" else 1

    def compiler_params_for(self, params: Any) -> Any:
        fields: dict[str, Any] = {"target": self.target, "kernel_type": self.kernel_type,
                  "num_cores": self.num_cores,
                  "num_subcores": self.num_subcores if self.kernel_type == "vector" else None}
        if params is None:
            return SCCompilerParams(**fields)
        if isinstance(params, SCCompilerParams):
            if params.target is not None and params.target != self.target and \
                    get_sparse_core_info(params.target) != self.info:
                raise PallasError(
                    f"plsc.CompilerParams(target={params.target!r}) disagrees with the mesh's "
                    f"chip {self.target!r}. Fix: name the chip once, on the mesh.")
            return dataclasses.replace(params, **fields)
        raise PallasError(
            f"a SparseCore mesh kernel got compiler_params of type {type(params).__name__}. "
            "Fix: pass plsc.CompilerParams(...) (JAX's pltpu.CompilerParams fields "
            "use_tc_tiling_on_sc and needs_layout_passes are there).")


def _target(target: str | None) -> str:
    if target is not None:
        get_sparse_core_info(target)
        return target
    kind = _ambient_device_kind()
    return kind if kind is not None else DEFAULT_TARGET


def VectorSubcoreMesh(*, core_axis_name: str, subcore_axis_name: str,
                      num_cores: int | None = None, num_subcores: int | None = None,
                      target: str | None = None) -> SubcoreMesh:
    """The vector subcores of ``num_cores`` SparseCores (default: all the chip has), each with
    ``num_subcores`` subcores; ``lax.axis_index(core_axis_name)`` and
    ``lax.axis_index(subcore_axis_name)`` name one."""
    chip = _target(target)
    info = get_sparse_core_info(chip)
    cores = _count(num_cores, "num_cores", info.num_cores, chip, "VectorSubcoreMesh")
    subcores = _count(num_subcores, "num_subcores", info.num_subcores, chip,
                      "VectorSubcoreMesh")
    if core_axis_name == subcore_axis_name:
        raise PallasError(f"plsc.VectorSubcoreMesh: the core and subcore axes are both named "
                          f"{core_axis_name!r}. Fix: give them different names.")
    return SubcoreMesh((core_axis_name, subcore_axis_name), (cores, subcores), backend=NAME,
                       kernel_type="vector", target=chip)


def ScalarSubcoreMesh(*, axis_name: str, num_cores: int | None = None,
                      target: str | None = None) -> SubcoreMesh:
    """The scalar subcores of ``num_cores`` SparseCores (one per core);
    ``lax.axis_index(axis_name)`` names one."""
    chip = _target(target)
    info = get_sparse_core_info(chip)
    cores = _count(num_cores, "num_cores", info.num_cores, chip, "ScalarSubcoreMesh")
    return SubcoreMesh((axis_name,), (cores,), backend=NAME, kernel_type="scalar",
                       target=chip)
