"""pallas-xla-unrolled: an example third-party backend for pallas.

It lowers a kernel to plain XLA by unrolling the grid in Python: every grid step becomes its own
straight-line copy of the kernel, with static block offsets and ``program_id`` as a constant.
Install it and pick it with ``pl.pallas_call(..., backend="xla_unrolled")`` or
``compiler_params=pallas_xla_unrolled.CompilerParams()``.
"""

from __future__ import annotations

from pallas_xla_unrolled.plugin import NAME, XlaUnrolledParams, __version__, step_index

CompilerParams = XlaUnrolledParams

__all__ = ["NAME", "CompilerParams", "XlaUnrolledParams", "__version__", "step_index"]
