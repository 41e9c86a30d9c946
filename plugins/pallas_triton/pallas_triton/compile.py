"""Compiling Triton IR to GPU code on any machine, through the ``triton`` package.

Only ``pl.stages`` needs this: at run time XLA compiles the kernel's Triton IR itself. The
stages are run one by one (not through ``triton.compile``, which skips the TTIR passes when
given IR), for an explicit target, so no GPU is needed. NVIDIA targets end in ``ptx`` and
``cubin``, AMD ones in ``amdgcn`` and ``hsaco``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

from pallas_core.errors import PallasError


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU that ``pl.stages`` compiles for: Triton's backend, its arch and warp size."""

    backend: str
    """Triton's backend: ``"cuda"`` or ``"hip"``."""
    arch: int | str
    """A compute capability (``90``) or an AMD ISA (``"gfx942"``)."""
    warp_size: int
    platform: str
    """The JAX platform that runs it: ``"cuda"`` or ``"rocm"``."""


TARGETS: dict[str, Target] = {
    "sm_80": Target("cuda", 80, 32, "cuda"),    # A100
    "sm_90": Target("cuda", 90, 32, "cuda"),    # H100, H200
    "sm_100": Target("cuda", 100, 32, "cuda"),  # B200
    "sm_120": Target("cuda", 120, 32, "cuda"),  # RTX 50xx
    "gfx90a": Target("hip", "gfx90a", 64, "rocm"),  # MI200 (CDNA2)
    "gfx942": Target("hip", "gfx942", 64, "rocm"),  # MI300 (CDNA3)
    "gfx950": Target("hip", "gfx950", 64, "rocm"),  # MI350 (CDNA4)
}
"""The targets ``pl.stages(..., backend="triton", target=...)`` accepts (each compiles with the
``triton`` package this plugin is tested with). ``"sm_90a"``/``"sm_100a"`` name the same
targets as ``"sm_90"``/``"sm_100"``: Triton picks the architecture-specific variant itself."""

DEFAULT_TARGET = "sm_90"


def parse_target(target: str | None) -> Target:
    """``"sm_90"`` (the default), ``"gfx942"``... -> its :class:`Target`."""
    name = target or DEFAULT_TARGET
    if name in ("sm_90a", "sm_100a"):
        name = name[:-1]
    if name not in TARGETS:
        raise PallasError(
            f"Triton target {target!r} is not one this plugin compiles for; known targets: "
            f"{', '.join(TARGETS)}. Fix: pass one of them, e.g. target='sm_90' (NVIDIA H100) "
            "or target='gfx942' (AMD MI300).")
    return TARGETS[name]


def default_num_stages(platform: str) -> int:
    """The software pipelining depth when none is given: JAX's (1 on ROCm, 3 on CUDA)."""
    return 1 if platform == "rocm" else 3


def compile_stages(ttir: str, target: str | None, num_warps: int,
                   num_stages: int | None) -> dict[str, Any]:
    """``ttir`` text through Triton's pipeline for ``target``: the stages ``ttir``
    (optimised), ``ttgir``, ``llir``, then ``ptx`` and ``cubin`` (NVIDIA) or ``amdgcn`` and
    ``hsaco`` (AMD). ``num_stages=None`` is the target platform's default."""
    gpu = parse_target(target)
    try:
        from triton._C.libtriton import ir as triton_ir
        from triton.backends.compiler import GPUTarget, Language
        from triton.compiler.compiler import make_backend
    except ImportError as e:
        raise PallasError(
            f"compiling Triton IR for target {target!r} to GPU code (PTX and cubin, or AMDGCN "
            "and hsaco) needs the `triton` package, an optional dependency that is not "
            "installed (lowering for cuda and rocm does not need it). "
            "Fix: pip install 'pallas-triton[compile]'") from e
    gpu_target = GPUTarget(gpu.backend, gpu.arch, gpu.warp_size)
    backend = make_backend(gpu_target)
    stages_count = default_num_stages(gpu.platform) if num_stages is None else num_stages
    options = backend.parse_options({"num_warps": num_warps, "num_stages": stages_count,
                                     "enable_fp_fusion": True})
    context = triton_ir.context()
    triton_ir.load_dialects(context)
    backend.load_dialects(context)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        module = triton_ir.parse_mlir_module(path, context)
    module.context = context
    stages: dict[str, Any] = {}
    backend.add_stages(stages, options, Language.TRITON)
    metadata: dict[str, Any] = {"target": gpu_target, **options.__dict__}
    out: dict[str, Any] = {}
    for name, stage in stages.items():
        try:
            module = stage(module, metadata)
        except Exception as e:  # Triton raises RuntimeError, ValueError... with its diagnostics
            raise PallasError(
                f"Triton's {name!r} stage failed for target {target or DEFAULT_TARGET!r}: "
                f"{str(e).strip()[:2000]}\nFix: check that the kernel's inline assembly, if "
                "any, is for this target's ISA (PTX for NVIDIA, AMDGCN for AMD), or compile "
                "for another target.") from e
        out[name] = module if isinstance(module, (str, bytes)) else str(module)
    return out
