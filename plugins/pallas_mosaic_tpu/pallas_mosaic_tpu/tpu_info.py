"""Public facts about TPU chips (``pltpu.get_tpu_info``, ``pltpu.TpuInfo``, ``pltpu.ChipVersion``).

The figures are per TensorCore, as in ``jax.experimental.pallas.tpu``: multiply by
``num_cores`` for a whole logical device. ``get_tpu_info()`` asks JAX which device is in use
(the abstract mesh's device when one is set, else the chip a kernel is traced, staged or
emulated for, else the default device); outside any kernel on a machine without a TPU it
raises, and ``get_tpu_info_for_chip`` gives the facts of a named chip instead.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp

from pallas_core.backend import PallasError, assumed_device

_KiB, _MiB = 1024, 1024 * 1024


class ChipVersion(enum.Enum):
    """A TPU generation; ``str()`` gives its short name (``"v5e"``, ``"7x"``)."""

    TPU_V2 = "v2"
    TPU_V3 = "v3"
    TPU_V4I = "v4i"
    TPU_V4 = "v4"
    TPU_V5E = "v5e"
    TPU_V5P = "v5p"
    TPU_V6E = "v6e"
    TPU_7 = "7"
    TPU_7X = "7x"
    TPU_8I = "8i"
    TPU_8T = "8t"

    def __str__(self) -> str:
        return self.value

    @property
    def num_physical_tensor_cores_per_chip(self) -> int:
        """TensorCores on one chip: 1 on the lite chips and 8t, 2 on the others."""
        return 1 if self.is_lite or self is ChipVersion.TPU_8T else 2

    @property
    def supports_megacore(self) -> bool:
        """Whether the chip's two TensorCores can act as one device (v4, v5p)."""
        return self in (ChipVersion.TPU_V4, ChipVersion.TPU_V5P)

    @property
    def is_lite(self) -> bool:
        """Whether this is a one-TensorCore ("lite") chip: v4i, v5e, v6e."""
        return self in (ChipVersion.TPU_V4I, ChipVersion.TPU_V5E, ChipVersion.TPU_V6E)


_DEVICE_KINDS = {
    "TPU v2": ChipVersion.TPU_V2, "TPU v3": ChipVersion.TPU_V3, "TPU v4": ChipVersion.TPU_V4,
    "TPU v4 lite": ChipVersion.TPU_V4I, "TPU v5e": ChipVersion.TPU_V5E,
    "TPU v5 lite": ChipVersion.TPU_V5E, "TPU v5": ChipVersion.TPU_V5P,
    "TPU v5p": ChipVersion.TPU_V5P, "TPU v6e": ChipVersion.TPU_V6E,
    "TPU v6 lite": ChipVersion.TPU_V6E, "TPU7": ChipVersion.TPU_7, "TPU7x": ChipVersion.TPU_7X,
    "TPU8i": ChipVersion.TPU_8I, "TPU8t": ChipVersion.TPU_8T,
}


def chip_version_from_device_kind(device_kind: str) -> ChipVersion | None:
    """The generation of a JAX ``device_kind`` (``"TPU v5 lite"``), or ``None`` if not a TPU."""
    return _DEVICE_KINDS.get(device_kind)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseCoreInfo:
    """The SparseCores of a chip: how many, their vector subcores and lanes, and the VMEM of
    each vector subcore."""

    num_cores: int
    num_subcores: int
    num_lanes: int
    vmem_capacity_bytes: int
    dma_granule_size_bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuInfo:
    """Facts about one TensorCore of a chip (``num_cores`` of them make a logical device).

    ``num_accumulators``: 32-bit accumulator buffers of shape ``(num_sublanes,
    mxu_column_size)`` per MXU (0 where unknown). Rates are per second; 0 means the chip has
    no such unit (or the figure is unknown).
    """

    chip_version: ChipVersion
    generation: int
    num_cores: int
    num_lanes: int
    num_sublanes: int
    mxu_column_size: int
    num_mxus: int
    num_accumulators: int
    vmem_capacity_bytes: int
    cmem_capacity_bytes: int
    smem_capacity_bytes: int
    hbm_capacity_bytes: int
    mem_bw_bytes_per_second: int
    bf16_ops_per_second: int
    int8_ops_per_second: int
    fp8_ops_per_second: int
    int4_ops_per_second: int
    sparse_core: SparseCoreInfo | None = None

    @property
    def is_lite(self) -> bool:
        """Whether the chip is a one-TensorCore chip."""
        return self.chip_version.is_lite

    @property
    def is_split_chip(self) -> bool:
        """Whether a two-TensorCore chip is used one core per device."""
        return self.num_cores == 1 and self.chip_version.num_physical_tensor_cores_per_chip > 1

    @property
    def is_megacore(self) -> bool:
        """Whether the chip's TensorCores act as one device."""
        return self.num_cores > 1

    def is_matmul_supported(self, lhs_dtype: Any, rhs_dtype: Any) -> bool:
        """Whether the MXU multiplies these operand types without converting them."""
        lhs, rhs = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)
        f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
        if self.generation in (2, 3):
            return lhs == rhs == f32
        if self.generation == 4:
            return lhs in (f32, bf16) and rhs in (f32, bf16, jnp.dtype(jnp.int8))
        if self.generation in (5, 6):
            groups = [(f32, bf16, jnp.dtype(jnp.float8_e5m2), jnp.dtype(jnp.float8_e4m3b11fnuz)),
                      (jnp.dtype(jnp.uint8), jnp.dtype(jnp.int8)),
                      (jnp.dtype(jnp.uint4), jnp.dtype(jnp.int4))]
            return any(lhs in g and rhs in g for g in groups)
        if self.generation in (7, 8):
            fp8 = (jnp.dtype(jnp.float8_e5m2), jnp.dtype(jnp.float8_e4m3fn))
            # 8i also takes 4-bit integer right operands; 8t signed ones.
            int4 = {ChipVersion.TPU_8I: (jnp.dtype(jnp.uint4), jnp.dtype(jnp.int4)),
                    ChipVersion.TPU_8T: (jnp.dtype(jnp.int4),)}.get(self.chip_version, ())
            return (lhs in (f32, bf16) and rhs in (f32, bf16, *int4)) or (
                lhs in (f32, bf16, *fp8) and rhs in (*fp8, *int4))
        return False

    def get_sublane_tiling(self, dtype: Any) -> int:
        """The rows of the second-minor tile XLA uses for ``dtype`` by default."""
        bits = jnp.dtype(dtype).itemsize * 8 if jnp.dtype(dtype) not in (
            jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) else 4
        if self.generation < 7:
            return self.num_sublanes if bits in (16, 32) else self.num_sublanes * (32 // bits)
        if self.generation in (7, 8):
            return self.num_sublanes * (32 // bits)
        raise PallasError(f"TpuInfo.get_sublane_tiling: no tiling is known for TPU generation "
                          f"{self.generation}.")


def _sc(cores: int, subcores: int, lanes: int, vmem_kib: int, granule: int) -> SparseCoreInfo:
    return SparseCoreInfo(num_cores=cores, num_subcores=subcores, num_lanes=lanes,
                          vmem_capacity_bytes=vmem_kib * _KiB, dma_granule_size_bytes=granule)


# Per chip: generation, MXU column size, MXUs, accumulators per MXU, VMEM MiB and SMEM KiB
# per core; CMEM bytes, HBM bytes, bandwidth and the bf16, int8, fp8 and int4 rates of the
# whole chip (shared between its TensorCores below); its SparseCores.
_CHIPS: dict[ChipVersion, tuple[Any, ...]] = {
    ChipVersion.TPU_V2: (2, 128, 1, 0, 16, 0, 16, 16_000_000_000, 7.16e11, 4.6e13, 0, 0, 0,
                         None),
    ChipVersion.TPU_V3: (3, 128, 2, 0, 16, 0, 16, 34_400_000_000, 8.25e11, 1.40e14, 0, 0, 0,
                         None),
    ChipVersion.TPU_V4I: (4, 128, 4, 0, 16, 134_000_000, 1024, 8_590_000_000, 6.14e11,
                          1.37e14, 0, 0, 0, None),
    ChipVersion.TPU_V4: (4, 128, 4, 0, 16, 134_000_000, 1024, 34_400_000_000, 1.23e12,
                         2.75e14, 0, 0, 0, None),
    ChipVersion.TPU_V5E: (5, 128, 4, 0, 128, 0, 1024, 17_200_000_000, 8.20e11, 1.97e14,
                          3.94e14, 0, 7.88e14, None),
    ChipVersion.TPU_V5P: (5, 128, 4, 0, 64, 0, 1024, 103_000_000_000, 2.46e12, 4.59e14,
                          9.18e14, 0, 1.84e15, _sc(4, 16, 8, 512, 32)),
    ChipVersion.TPU_V6E: (6, 256, 2, 0, 128, 0, 1024, 34_400_000_000, 1.64e12, 9.20e14,
                          1.84e15, 9.20e14, 3.68e15, _sc(2, 16, 8, 256, 32)),
    ChipVersion.TPU_7: (7, 256, 2, 128, 64, 0, 1024, 206_000_000_000, 7.40e12, 2.31e15, 0,
                        4.60e15, 0, _sc(2, 16, 16, 512, 32)),
    ChipVersion.TPU_7X: (7, 256, 2, 128, 64, 0, 1024, 206_000_000_000, 7.40e12, 2.31e15, 0,
                         4.60e15, 0, _sc(2, 16, 16, 512, 32)),
    ChipVersion.TPU_8I: (8, 256, 2, 256, 192, 0, 1024, 309_000_000_000, 8.60e12, 1.101e15, 0,
                         8.808e15, 0, _sc(1, 4, 16, 512, 64)),
    ChipVersion.TPU_8T: (8, 256, 2, 256, 128, 0, 1024, 231_000_000_000, 6.4e12, 0.9961e15,
                         0.9961e15, 5.9769e15, 11.9538e15, _sc(2, 16, 16, 256, 64)),
}
_SUBLANES = {ChipVersion.TPU_8T: 16}
"""Rows of a vector register where not 8."""


def _info(chip: ChipVersion, num_cores: int) -> TpuInfo:
    (gen, mxu_cols, mxus, accs, vmem_mib, cmem, smem_kib, hbm, bw, bf16, int8, fp8, int4,
     sparse_core) = _CHIPS[chip]
    # The chip's memory and rates are shared by its TensorCores; v4i, v5e and v6e have one.
    # (v4i's CMEM is its own: that chip has a single core.)
    share = chip.num_physical_tensor_cores_per_chip

    def per_core(x: float) -> int:
        return int(x // share)

    return TpuInfo(
        chip_version=chip, generation=gen, num_cores=num_cores, num_lanes=128,
        num_sublanes=_SUBLANES.get(chip, 8),
        mxu_column_size=mxu_cols, num_mxus=mxus, num_accumulators=accs,
        vmem_capacity_bytes=vmem_mib * _MiB, cmem_capacity_bytes=per_core(cmem),
        smem_capacity_bytes=smem_kib * _KiB, hbm_capacity_bytes=per_core(hbm),
        mem_bw_bytes_per_second=per_core(bw), bf16_ops_per_second=per_core(bf16),
        int8_ops_per_second=per_core(int8), fp8_ops_per_second=per_core(fp8),
        int4_ops_per_second=per_core(int4), sparse_core=sparse_core)


_SHEETS = {"v4": "v4", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e", "v7x": "tpu7x"}


def roofline_chips(default_vmem_limit: int) -> dict[str, Any]:
    """The chips of ``pl.report`` (``BackendInfo.chips``): whole-chip matrix peaks per type
    and HBM bandwidth from the table above, VMEM per TensorCore, ``default_vmem_limit`` (what
    the lowering lets a kernel use unless ``vmem_limit_bytes`` says more)."""
    from pallas_core.backend import Chip

    chips = {}
    for name, version in (("v5e", ChipVersion.TPU_V5E), ("v4", ChipVersion.TPU_V4),
                          ("v5p", ChipVersion.TPU_V5P), ("v6e", ChipVersion.TPU_V6E),
                          ("v7x", ChipVersion.TPU_7X)):
        (_, _, _, _, vmem_mib, _, _, _, bw, bf16, int8, fp8, _, _) = _CHIPS[version]
        peaks = {"bfloat16": bf16, **({"int8": int8} if int8 else {}),
                 **({"float8": fp8} if fp8 else {})}
        chips[name] = Chip(
            name=name, matmul_flops=peaks, hbm_bandwidth=bw, onchip_name="VMEM",
            onchip_bytes=vmem_mib * _MiB, onchip_default_limit=default_vmem_limit,
            cores=version.num_physical_tensor_cores_per_chip,
            source=f"Google Cloud TPU documentation, cloud.google.com/tpu/docs/{_SHEETS[name]} "
                   "(chip specifications), as jax.experimental.pallas.tpu's TpuInfo has them")
    return chips


def get_tpu_info_for_chip(chip_version: ChipVersion,
                          num_tensor_cores_per_logical_device: int) -> TpuInfo:
    """The facts of ``chip_version`` used with ``num_tensor_cores_per_logical_device``
    TensorCores per device: 1, or 2 for the megacore chips (v4, v5p) used as one device."""
    if not isinstance(chip_version, ChipVersion):
        raise PallasError(f"get_tpu_info_for_chip: expected a pltpu.ChipVersion, found "
                          f"{chip_version!r}. Fix: e.g. pltpu.ChipVersion.TPU_V5E.")
    cores = num_tensor_cores_per_logical_device
    allowed = (1, 2) if chip_version.supports_megacore else (1,)
    if cores not in allowed:
        raise PallasError(
            f"get_tpu_info_for_chip({chip_version}, num_tensor_cores_per_logical_device="
            f"{cores!r}): a {chip_version} device has {' or '.join(map(str, allowed))} "
            "TensorCores (only v4 and v5p join their two cores into one device). Fix: pass 1"
            f"{' or 2' if len(allowed) == 2 else ''}.")
    return _info(chip_version, cores)


def _current_device() -> tuple[str, int | None]:
    """The abstract mesh's device, else the chip a trace or lowering is for where no TPU is
    attached (``pl.stages``/``pl.emulate``'s target, a kernel traced for Mosaic TPU), else
    JAX's default device."""
    abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if abstract:
        return abstract.device_kind, getattr(abstract, "num_cores", None)
    assumed = assumed_device("tpu")
    if assumed is not None:
        return assumed
    device = jax.devices()[0]
    return device.device_kind, getattr(device, "num_cores", None)


def is_tpu_device() -> bool:
    """Whether JAX's current device (the abstract mesh's, else the default) is a TPU."""
    return chip_version_from_device_kind(_current_device()[0]) is not None


def get_tpu_info() -> TpuInfo:
    """The facts of the TPU JAX compiles for: the abstract mesh's device, else the target chip
    of the kernel being traced, staged or emulated where no TPU is attached (the ``target=`` of
    ``pl.stages``/``pl.emulate``, else Mosaic TPU's default, v5e), else the default device."""
    kind, cores = _current_device()
    chip = chip_version_from_device_kind(kind)
    if chip is None:
        raise PallasError(
            f"pltpu.get_tpu_info: JAX's current device is {kind!r}, not a TPU. Fix: on a "
            "machine without a TPU, use pltpu.get_tpu_info_for_chip(pltpu.ChipVersion..., 1).")
    return _info(chip, cores or 1)


class Tiling(enum.Enum):
    """Memory tilings of TPU arrays: ``COMPACT`` (TensorCore ``(8, 128)`` tiles) and
    ``SPARSE_CORE`` (``(8,)``)."""

    COMPACT = enum.auto()
    SPARSE_CORE = enum.auto()

    @property
    def shape(self) -> tuple[int, ...]:
        """The tile's shape (of 32-bit elements)."""
        return (8, 128) if self is Tiling.COMPACT else (8,)
