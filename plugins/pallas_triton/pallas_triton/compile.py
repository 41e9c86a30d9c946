"""Compiling Triton IR to GPU code on any machine, through the ``triton`` package.

Only ``pl.stages`` needs this: at run time XLA compiles the kernel's Triton IR itself. The
stages are run one by one (not through ``triton.compile``, which skips the TTIR passes when
given IR), for an explicit target, so no GPU is needed.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any

from pallas_core.errors import PallasError


def parse_target(target: str | None) -> tuple[str, int]:
    """``"sm_90"`` (the default) or ``"sm_80"``... -> ``("cuda", 90)``."""
    target = target or "sm_90"
    m = re.fullmatch(r"sm_(\d+)a?", target)
    if m is None:
        raise PallasError(f"Triton target {target!r}: expected 'sm_XY' (e.g. 'sm_80', "
                          "'sm_90'). Fix: pass target='sm_90'.")
    return "cuda", int(m.group(1))


def compile_stages(ttir: str, target: str | None, num_warps: int,
                   num_stages: int) -> dict[str, Any]:
    """``ttir`` text through Triton's pipeline: the stages ``ttir`` (optimised), ``ttgir``,
    ``llir``, ``ptx`` and ``cubin`` for ``target``."""
    try:
        from triton._C.libtriton import ir as triton_ir
        from triton.backends.compiler import GPUTarget, Language
        from triton.compiler.compiler import make_backend
    except ImportError as e:
        raise PallasError(
            "compiling Triton IR to PTX and cubin needs the `triton` package. Fix: "
            "pip install triton") from e
    backend_name, arch = parse_target(target)
    gpu_target = GPUTarget(backend_name, arch, 32)
    backend = make_backend(gpu_target)
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages,
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
        module = stage(module, metadata)
        out[name] = module if isinstance(module, (str, bytes)) else str(module)
    return out
