"""Public datasheet figures of the GPUs more than one backend compiles for, written once.

Triton and Mosaic GPU target the same NVIDIA chips; each lists its own in ``BackendInfo.chips``
by taking entries from :data:`GPU_CHIPS` (through ``pallas_core.backend``), so a figure is
corrected in one place. Each :class:`~pallas_core.roofline.Chip` names its sheet in ``source``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from pallas_core.roofline import Chip

_KiB = 1024


def _gpu(name: str, matmul: dict[str, float], bandwidth: float, smem_kib: int, cores: int,
         source: str, vector: dict[str, float] | None = None) -> Chip:
    # The on-chip figure is the shared memory one thread block may use (CUDA's opt-in maximum
    # per block; an AMD CU's LDS), which is also the limit a kernel meets.
    return Chip(name=name, matmul_flops=dict(matmul), hbm_bandwidth=bandwidth,
                onchip_name="shared memory", onchip_bytes=smem_kib * _KiB,
                onchip_default_limit=smem_kib * _KiB, cores=cores, source=source,
                vector_flops=dict(vector or {}))


_HOPPER = {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12,
           "float8": 1978.9e12, "int8": 1978.9e12}
"""H100 and H200 SXM share the tensor cores (dense peaks); they differ in HBM."""

GPU_CHIPS: Mapping[str, Chip] = types.MappingProxyType({
    "h100": _gpu("h100", _HOPPER, 3.35e12, 227, 132,
                 "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM, dense)", {"float32": 66.9e12}),
    "a100": _gpu("a100", {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12,
                          "int8": 624e12}, 2.039e12, 163, 108,
                 "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM, dense)",
                 {"float32": 19.5e12}),
    "h200": _gpu("h200", _HOPPER, 4.8e12, 227, 132,
                 "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM, dense)", {"float32": 66.9e12}),
    "b200": _gpu("b200", {"bfloat16": 2.25e15, "float16": 2.25e15, "float32": 1.1e15,
                          "float8": 4.5e15, "int8": 4.5e15}, 8.0e12, 227, 148,
                 "NVIDIA HGX B200 datasheet (per GPU, dense)"),
    "mi300x": _gpu("mi300x", {"bfloat16": 1307.4e12, "float16": 1307.4e12,
                              "float32": 163.4e12, "float8": 2614.9e12, "int8": 2614.9e12},
                   5.3e12, 64, 304, "AMD Instinct MI300X accelerator datasheet (dense)",
                   {"float32": 163.4e12}),
})
"""Target name -> :class:`~pallas_core.roofline.Chip` of each GPU a backend of this project
targets, in the order Triton lists them (its default, ``h100``, first): dense tensor-core
peaks per type, HBM bandwidth, the shared memory one thread block may use (CUDA's opt-in
maximum: 227 KiB on compute capability 9.0 and 10.0, 163 KiB on 8.0; 64 KiB of LDS per CU on
the MI300X), and the CUDA-core (or SIMD) float32 peak where the sheet gives one."""
