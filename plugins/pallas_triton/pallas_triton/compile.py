"""Compiling Triton IR to GPU code on any machine, through the ``triton`` package.

Only ``pl.stages`` needs this: at run time XLA compiles the kernel's Triton IR itself. The
stages are run one by one (not through ``triton.compile``, which skips the TTIR passes when
given IR), for an explicit target, so no GPU is needed. NVIDIA targets end in ``ptx`` and
``cubin``, AMD ones in ``amdgcn`` and ``hsaco``.

After the ``llir`` stage Triton has allocated the kernel's shared memory (its ``shared``
metadata, in bytes): :func:`shared_memory` stops there, for ``pl.report``'s footprint, and
:func:`compile_stages` refuses a kernel that needs more than its target's limit, as Triton's
launcher (and XLA's) would on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from pallas_core.backend import PallasError


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
    shared_memory: int
    """The most shared memory (LDS on AMD) one thread block may use, in bytes: the driver's
    per-block maximum (NVIDIA's opt-in maximum), beyond which Triton's launcher refuses the
    kernel ("out of resource: shared memory")."""


_KiB = 1024

TARGETS: dict[str, Target] = {
    # Shared memory: the CUDA C++ Programming Guide's "maximum amount of shared memory per
    # thread block" per compute capability; AMD's LDS per workgroup from its ISA guides.
    "sm_80": Target("cuda", 80, 32, "cuda", 163 * _KiB),    # A100
    "sm_90": Target("cuda", 90, 32, "cuda", 227 * _KiB),    # H100, H200
    "sm_100": Target("cuda", 100, 32, "cuda", 227 * _KiB),  # B200
    "sm_120": Target("cuda", 120, 32, "cuda", 99 * _KiB),   # RTX 50xx
    "gfx90a": Target("hip", "gfx90a", 64, "rocm", 64 * _KiB),   # MI200 (CDNA2)
    "gfx942": Target("hip", "gfx942", 64, "rocm", 64 * _KiB),   # MI300 (CDNA3)
    "gfx950": Target("hip", "gfx950", 64, "rocm", 160 * _KiB),  # MI350 (CDNA4)
}
"""The targets ``pl.stages(..., backend="triton", target=...)`` accepts (each compiles with the
``triton`` package this plugin is tested with). ``"sm_90a"``/``"sm_100a"`` name the same
targets as ``"sm_90"``/``"sm_100"``: Triton picks the architecture-specific variant itself."""

DEFAULT_TARGET = "sm_90"

CHIP_TARGETS: dict[str, str] = {"h100": "sm_90", "h200": "sm_90", "a100": "sm_80",
                                "b200": "sm_100", "mi300x": "gfx942"}
"""``pl.report``'s chips (``BackendInfo.chips``) -> the target each compiles for."""


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


def target_of_chip(chip: str | None) -> str:
    """The target that ``pl.report``'s chip ``chip`` (``"h100"``; ``None``: the default)
    compiles for."""
    if chip is None:
        return DEFAULT_TARGET
    if chip not in CHIP_TARGETS:
        raise PallasError(
            f"the Triton backend knows no compile target for chip {chip!r}; chips it "
            f"compiles for: {', '.join(CHIP_TARGETS)}. Fix: pass one of them as target=, or "
            "add the chip to pallas_triton.compile.CHIP_TARGETS with the chip table.")
    return CHIP_TARGETS[chip]


def default_num_stages(platform: str) -> int:
    """The software pipelining depth when none is given: JAX's (1 on ROCm, 3 on CUDA)."""
    return 1 if platform == "rocm" else 3


_IMPORT_LOCK = threading.Lock()
"""Held while the ``triton`` package is first imported: threads importing it at once can meet
its modules partially initialized ("cannot import name 'compile' from partially initialized
module 'triton.compiler'"), which must not read as "not installed"."""


@dataclasses.dataclass(frozen=True)
class _Triton:
    ir: Any
    GPUTarget: Any
    Language: Any
    make_backend: Any


@functools.lru_cache(maxsize=1)
def _triton() -> _Triton | ImportError:
    """Triton's compiler entry points, imported once under :data:`_IMPORT_LOCK` (or the
    ``ImportError`` that importing them raised)."""
    with _IMPORT_LOCK:
        try:
            from triton._C.libtriton import ir as triton_ir
            from triton.backends.compiler import GPUTarget, Language
            from triton.compiler.compiler import make_backend
        except ImportError as e:
            return e
    return _Triton(triton_ir, GPUTarget, Language, make_backend)


def available() -> bool:
    """Whether the ``triton`` package (the ``compile`` extra) is installed."""
    return not isinstance(_triton(), ImportError)


def compile_stages(ttir: str, target: str | None, num_warps: int,
                   num_stages: int | None, *, kernel: str = "kernel") -> dict[str, Any]:
    """``ttir`` text through Triton's pipeline for ``target``: the stages ``ttir``
    (optimised), ``ttgir``, ``llir``, then ``ptx`` and ``cubin`` (NVIDIA) or ``amdgcn`` and
    ``hsaco`` (AMD). ``num_stages=None`` is the target platform's default.

    Raises a ``PallasError`` naming ``kernel`` when, after ``llir``, the kernel needs more
    shared memory than the target's thread blocks may use (the GPU would refuse to run it)."""
    gpu = parse_target(target)
    out: dict[str, Any] = {}
    for name, module, metadata in _run(ttir, target, num_warps, num_stages):
        out[name] = module
        if name == "llir":
            _check_fits(kernel, _shared(metadata), gpu, target, num_warps, metadata)
    return out


@functools.lru_cache(maxsize=256)
def shared_memory(ttir: str, target: str | None, num_warps: int,
                  num_stages: int | None) -> int:
    """The bytes of shared memory Triton allocates for ``ttir`` on ``target``: its ``shared``
    metadata after the ``llir`` stage (the later stages do not change it). Remembered, by the IR
    and the options, so that a kernel reported again is not compiled again."""
    for name, _, metadata in _run(ttir, target, num_warps, num_stages):
        if name == "llir":
            return _shared(metadata)
    raise PallasError(f"Triton's pipeline for target {target!r} has no 'llir' stage. Fix: "
                      "use a triton version this plugin is tested with.")


def _shared(metadata: dict[str, Any]) -> int:
    return int(metadata.get("shared") or 0)


def _check_fits(kernel: str, shared: int, gpu: Target, target: str | None, num_warps: int,
                metadata: dict[str, Any]) -> None:
    if shared <= gpu.shared_memory:
        return
    raise PallasError(
        f"Triton kernel {kernel!r} needs {shared} bytes ({shared / _KiB:.1f} KiB) of shared "
        f"memory on target {target or DEFAULT_TARGET!r} (num_warps={num_warps}, "
        f"num_stages={metadata.get('num_stages')}), more than the {gpu.shared_memory} bytes "
        f"({gpu.shared_memory / _KiB:.0f} KiB) one thread block may use there; the GPU would "
        "refuse to run it. Fix: use smaller blocks (the tiles a dot or a loop's loads "
        "hold), or fewer pipeline stages (TritonParams(num_stages=...): each stage buffers "
        "a loop's loads once more).")


def _run(ttir: str, target: str | None, num_warps: int,
         num_stages: int | None) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """Runs Triton's stages one by one, yielding each stage's name, output (text, or bytes
    for binaries) and Triton's metadata so far; the caller stops when it has what it needs."""
    gpu = parse_target(target)
    found = _triton()
    if isinstance(found, ModuleNotFoundError) and (found.name or "").split(".")[0] == "triton":
        raise PallasError(
            f"compiling Triton IR for target {target!r} to GPU code (PTX and cubin, or AMDGCN "
            "and hsaco) needs the `triton` package, an optional dependency that is not "
            "installed (lowering for cuda and rocm does not need it). "
            "Fix: pip install 'pallas-triton[compile]'") from found
    if isinstance(found, ImportError):
        raise PallasError(
            f"the `triton` package is installed but could not be imported ({found}). Fix: "
            "reinstall it in a version this plugin supports (pip install "
            "'pallas-triton[compile]'), or check the error above.") from found
    triton_ir, Language = found.ir, found.Language
    gpu_target = found.GPUTarget(gpu.backend, gpu.arch, gpu.warp_size)
    backend = found.make_backend(gpu_target)
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
    for name, stage in stages.items():
        try:
            module = stage(module, metadata)
        except Exception as e:  # Triton raises RuntimeError, ValueError... with its diagnostics
            raise PallasError(
                f"Triton's {name!r} stage failed for target {target or DEFAULT_TARGET!r}: "
                f"{str(e).strip()[:2000]}\nFix: check that the kernel's inline assembly, if "
                "any, is for this target's ISA (PTX for NVIDIA, AMDGCN for AMD), or compile "
                "for another target.") from e
        yield name, module if isinstance(module, (str, bytes)) else str(module), metadata
