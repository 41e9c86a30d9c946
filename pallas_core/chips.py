"""The chip a kernel is traced or lowered for, where no device of its platform is attached.

JAX's code and the plugins' chip queries (``pltpu.get_tpu_info()``,
``pallas_triton.get_gpu_info()``) ask which device they compile for. On a machine without that
hardware, ``pl.emulate(target=...)``, ``pl.stages(target=...)`` and the tracing of a kernel
whose backend is known (``backend=``, or its compiler parameters' type) tell them the target
chip: the named target's device kind (``BackendInfo.device_kinds``), else the backend's first
(default) one. A device that is attached always answers for itself.
"""

from __future__ import annotations

import contextlib
from typing import Any

from pallas_core import _jax
from pallas_core.plugins import manager


def _hardware_platform(platforms: tuple[str, ...], target: str | None) -> str | None:
    hardware = [p for p in platforms if p != "cpu"]
    if not hardware:
        return None
    if target is not None and target.startswith("gfx") and "rocm" in hardware:
        return "rocm"
    return hardware[0]


def backend_of_target(target: str) -> str | None:
    """The first loaded backend (by name) whose ``device_kinds`` name ``target``."""
    for name, b in sorted(manager.backends().items()):
        if target in b.info.device_kinds:
            return name
    return None


def target_chip(backend: str | None, target: str | None = None, *,
                keep_assumed: bool = False) -> contextlib.AbstractContextManager[Any]:
    """Inside, chip queries for ``backend``'s platform answer for ``target`` (a key of its
    ``device_kinds``; ``None``: the first), unless a device of that platform is attached, the
    backend declares no device kinds, or (with ``keep_assumed``) a chip is assumed already
    on one of the backend's platforms (an AMD target is assumed on ``rocm``),
    as when a kernel is traced inside ``pl.emulate``/``pl.stages`` with a target of their own."""
    if backend is None:
        return contextlib.nullcontext()
    info = manager.get(backend).info
    platform = _hardware_platform(info.platforms, target)
    kinds = dict(info.device_kinds)
    if platform is None or not kinds:
        return contextlib.nullcontext()
    kind = kinds.get(target or "", next(iter(kinds.values())))
    hardware = [p for p in info.platforms if p != "cpu"]
    if _jax.platform_attached(platform) or (keep_assumed and any(
            _jax.assumed_device(p) is not None for p in hardware)):
        return contextlib.nullcontext()
    return _jax.chip_answers(kind, platform)
