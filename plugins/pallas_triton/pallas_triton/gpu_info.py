"""Public facts about GPUs (``GpuInfo``, ``GpuVersion``, ``get_gpu_info``), as
``jax.experimental.pallas.triton`` gives them: the GPU's model, its architecture name and its
compute capability.

``get_gpu_info()`` answers for the device JAX compiles for: the abstract mesh's device when one
is set, else the chip a kernel is traced, staged or emulated for where no GPU is attached
(``pl.emulate``/``pl.stages``' ``target=``, else this backend's default, ``sm_90``: an H100),
else JAX's default device. Outside any kernel on a machine without a GPU it raises a
``PallasError`` (JAX raises ``ValueError``); ``get_gpu_info_from_version`` needs no device.
"""

from __future__ import annotations

import dataclasses
import enum
import re

import jax

from pallas_core import backend as plb
from pallas_core.backend import PallasError, assumed_device


class GpuVersion(enum.Enum):
    """A GPU model, its value the model's name as JAX's ``device_kind`` spells it."""

    A10 = "NVIDIA A10"
    A30 = "NVIDIA A30"
    A100 = "NVIDIA A100"
    H100 = "NVIDIA H100"
    H200 = "NVIDIA H200"
    GH200 = "NVIDIA GH200"
    B200 = "NVIDIA B200"
    GB200 = "NVIDIA GB200"
    B300 = "NVIDIA B300"
    GB300 = "NVIDIA GB300"
    GB10 = "NVIDIA GB10"
    L4 = "NVIDIA L4"
    L40 = "NVIDIA L40"
    T4 = "Tesla T4"
    RTX_4090 = "NVIDIA GeForce RTX 4090"
    RTX_PRO_4500 = "NVIDIA RTX PRO 4500"
    RTX_PRO_5000 = "NVIDIA RTX PRO 5000"
    RTX_PRO_6000 = "NVIDIA RTX PRO 6000"
    THOR = "NVIDIA Thor"
    VR200 = "NVIDIA VR200"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuInfo:
    """A GPU's facts: its model (``None`` for a GPU known only by its architecture, such as an
    AMD ``gfx942``), its architecture name (``"9.0"``, ``"gfx942"``) and its compute capability
    as an int (``90``; 0 on AMD)."""

    gpu_version: GpuVersion | None
    arch_name: str
    compute_capability: int


_CAPABILITY = {
    GpuVersion.T4: 75, GpuVersion.A100: 80, GpuVersion.A30: 80, GpuVersion.A10: 86,
    GpuVersion.L4: 89, GpuVersion.L40: 89, GpuVersion.RTX_4090: 89,
    GpuVersion.H100: 90, GpuVersion.H200: 90, GpuVersion.GH200: 90,
    GpuVersion.B200: 100, GpuVersion.GB200: 100, GpuVersion.B300: 103, GpuVersion.GB300: 103,
    GpuVersion.VR200: 107, GpuVersion.THOR: 110, GpuVersion.RTX_PRO_4500: 120,
    GpuVersion.RTX_PRO_5000: 120, GpuVersion.RTX_PRO_6000: 120, GpuVersion.GB10: 121,
}
"""Each model's compute capability (NVIDIA's published table)."""

# The longest names first, so that "NVIDIA A100" is not read as "NVIDIA A10".
_MODEL = re.compile(r"\b(" + "|".join(
    re.escape(v.value) for v in sorted(GpuVersion, key=lambda v: -len(v.value))) + r")\b")

_AMD_ARCH = {"AMD Instinct MI300X": "gfx942", "AMD Instinct MI250X": "gfx90a",
             "AMD Instinct MI355X": "gfx950"}
"""The architectures of the AMD GPUs this backend targets, by device kind."""

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def get_gpu_info_from_version(gpu_version: GpuVersion) -> GpuInfo:
    """The facts of the GPU model ``gpu_version``."""
    if not isinstance(gpu_version, GpuVersion):
        raise PallasError(f"get_gpu_info_from_version: expected a GpuVersion, found "
                          f"{gpu_version!r}. Fix: e.g. pallas_triton.GpuVersion.H100.")
    cc = _CAPABILITY[gpu_version]
    return GpuInfo(gpu_version=gpu_version, arch_name=f"{cc // 10}.{cc % 10}",
                   compute_capability=cc)


def _current_device() -> tuple[str, str, str | None]:
    """``(device_kind, platform, compute_capability)`` of the device JAX compiles for."""
    abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if abstract:
        return abstract.device_kind, abstract.platform, None
    for platform in ("cuda", "rocm"):
        assumed = assumed_device(platform)
        if assumed is not None:
            return assumed[0], platform, None
    device = jax.devices()[0]
    return device.device_kind, device.platform, getattr(device, "compute_capability", None)


def is_gpu_device() -> bool:
    """Whether the device JAX compiles for is a GPU (NVIDIA or AMD)."""
    return _current_device()[1] in _GPU_PLATFORMS


def get_gpu_info() -> GpuInfo:
    """The facts of the GPU JAX compiles for (see the module's docstring for which)."""
    kind, platform, cc = _current_device()
    found = _MODEL.search(kind)
    if found is not None:
        return get_gpu_info_from_version(GpuVersion(found.group(1)))
    if platform in _GPU_PLATFORMS:
        if isinstance(cc, str) and cc.startswith("gfx"):
            return GpuInfo(gpu_version=None, arch_name=cc, compute_capability=0)
        if kind.startswith("gfx") or kind in _AMD_ARCH:
            return GpuInfo(gpu_version=None, arch_name=_AMD_ARCH.get(kind, kind),
                           compute_capability=0)
        if kind.startswith("NVIDIA") and isinstance(cc, str):
            return GpuInfo(gpu_version=None, arch_name=cc,
                           compute_capability=int(cc.replace(".", "")))
    raise PallasError(
        f"pallas_triton.get_gpu_info: JAX's current device is {kind!r} ({platform}), not a GPU "
        "this backend knows. Fix: on a machine without a GPU, use "
        "pallas_triton.get_gpu_info_from_version(pallas_triton.GpuVersion...), or ask inside "
        "a kernel traced for Triton (backend='triton', pl.stages/pl.emulate with target=).")


def roofline_chips() -> dict[str, plb.Chip]:
    """The GPUs of ``pl.report`` (``BackendInfo.chips``): all of the core's GPU datasheets
    (``pallas_core.backend.GPU_CHIPS``: h100, this backend's default, then a100, h200, b200
    and mi300x), each with its dense tensor-core peaks, HBM bandwidth and the shared memory
    one thread block may use."""
    return dict(plb.GPU_CHIPS)
