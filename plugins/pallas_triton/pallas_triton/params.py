"""The Triton backend's compiler parameters."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pallas_core.backend import CompilerParams, PallasError

NAME = "triton"


@dataclasses.dataclass(frozen=True)
class TritonParams(CompilerParams):
    """Compiler parameters of the Triton backend; passing them selects it.

    ``num_warps``: warps per program (a power of two, 1 to 32). ``num_stages``: software
    pipelining depth of loops. ``debug``: let Triton keep device-side assertions. As in JAX,
    ``None`` means the default: 4 warps; 3 stages on CUDA, 1 on ROCm (``num_stages`` stays
    ``None`` until the kernel is lowered for a platform).
    """

    BACKEND: ClassVar[str] = NAME
    num_warps: int = 4
    num_stages: int | None = None
    debug: bool = False

    def __post_init__(self) -> None:
        # JAX's kernels pass num_warps=None for "the default".
        if self.num_warps is None:
            object.__setattr__(self, "num_warps", 4)
        w = self.num_warps
        if not isinstance(w, int) or w < 1 or w > 32 or w & (w - 1):
            raise PallasError(f"TritonParams(num_warps={w!r}): expected a power of two from 1 "
                              "to 32. Fix: e.g. num_warps=4.")
        if self.num_stages is not None and (not isinstance(self.num_stages, int)
                                            or self.num_stages < 1):
            raise PallasError(f"TritonParams(num_stages={self.num_stages!r}): expected a "
                              "positive int. Fix: e.g. num_stages=3.")
