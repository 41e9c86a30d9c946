"""Emulation: the modules hardware backends emit, executed on CPU with numpy.

:mod:`~pallas_core.emulation.machine` compiles MLIR functions into steps over numpy values with
a table of per-operation rules; :mod:`~pallas_core.emulation.arith` gives the ``arith`` and
``math`` rules every emulator shares; :mod:`~pallas_core.emulation.types` maps MLIR types to
numpy. A backend's emulator adds its dialect's rules and walks its grid, and receives the custom
calls to run as :class:`EmulatedCall` through its ``pallas_emulate`` hook (the devices of a
``shard_map`` meet there through :meth:`EmulatedCall.run_jointly`). Programs that wait for each
other run in :class:`~pallas_core.emulation.turns.Turns`.
:func:`~pallas_core.emulation.api.emulate` (``pl.emulate``) is the users' entry point.
"""

from pallas_core.emulation.call import EmulatedCall, EmulateOptions, Joint
from pallas_core.emulation.machine import CONTROL_FLOW, Compiler, Function, Region, Rule
from pallas_core.emulation.turns import Turns

__all__ = ["CONTROL_FLOW", "Compiler", "EmulateOptions", "EmulatedCall", "Function", "Joint",
           "Region", "Rule", "Turns"]
