"""The interpreter backend of pallas: runs any kernel wherever JAX runs, CPU included.

It is the executable specification of every primitive: kernels run through the reference
semantics that each plugin registers, so results here are what every backend must match.
"""

from __future__ import annotations

from pallas_interpret.params import InterpretParams
from pallas_interpret.plugin import __version__

CompilerParams = InterpretParams

__all__ = ["CompilerParams", "InterpretParams", "__version__"]
