"""``python -m pallas_core``: the installed backends, their versions and platforms (``--json``:
the same as a JSON object); and ``python -m pallas_core report MODULE:FUNCTION SHAPE...``,
``pl.report`` from the command line.

``report`` imports ``FUNCTION`` from ``MODULE`` (the current directory is searched first, as
``python -m`` does), calls ``pl.report`` on it with one ``jax.ShapeDtypeStruct`` per ``SHAPE``
(``DTYPE[D0,D1,...]``: ``bf16[4096,4096]``, ``i32[8]``, ``f32[]`` for a scalar), prints the
table and, with ``--out``, writes the page of pictures (:meth:`pallas_core.report.Report.save`).
Input it cannot use (a module or function not found, a shape it cannot read, an unknown chip
or backend) is an error that says what it expected, what it found and the fix, and the exit
status is 2.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

from pallas_core import __version__
from pallas_core.errors import ArgumentError, PallasError
from pallas_core.plugins import manager

_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
           "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8",
           "u16": "uint16", "u32": "uint32", "u64": "uint64", "pred": "bool",
           "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}
_SHAPE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\[\s*(\d+(?:\s*,\s*\d+)*)?\s*,?\s*\]\s*$")
_SHAPE_HELP = ("DTYPE[D0,D1,...], e.g. bf16[4096,4096], i32[8] or f32[] (a scalar); DTYPE "
               f"is one of {', '.join(_DTYPES)} or a NumPy name (float32, bfloat16, ...)")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (2 for input it cannot use)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, report = _parser()
    if argv[:1] == ["report"]:  # options may come between the function and the shapes
        args = report.parse_intermixed_args(argv[1:])
    else:
        args = parser.parse_args(argv)
    if args.command == "report":
        try:
            return _report(args)
        except PallasError as e:
            print(f"python -m pallas_core report: error: {e}", file=sys.stderr)
            return 2
    return _backends_json() if args.json else _backends()


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(
        prog="python -m pallas_core",
        description="With no command: the installed backends, their versions and platforms "
                    "(exit status 1 if one failed to load).")
    parser.add_argument("--version", action="version",
                        version=f"pallas-core {__version__} (jax {jax.__version__})")
    parser.add_argument("--json", action="store_true",
                        help="print the backends as one JSON object (versions, platforms, "
                             "capabilities, and those skipped or failed to load)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    report = commands.add_parser(
        "report", help="pl.report of a function on arrays of the given shapes",
        description="Traces FUNCTION on one jax.ShapeDtypeStruct per SHAPE (nothing runs), "
                    "prints pl.report's table and, with --out, writes its page of pictures. "
                    "Quote the shapes in shells that expand brackets (zsh).",
        epilog="example: python -m pallas_core report examples.report_matmul:matmul "
               "--backend mosaic_tpu --target v5e --out kernel.html "
               "'bf16[4096,4096]' 'bf16[4096,4096]'")
    report.add_argument("function", metavar="MODULE:FUNCTION",
                        help="the function to report, e.g. examples.report_matmul:matmul")
    report.add_argument("shapes", metavar="SHAPE", nargs="*",
                        help=f"one per positional argument of FUNCTION: {_SHAPE_HELP}")
    report.add_argument("--backend", help="the backend that compiles the kernels (default: the "
                        "one each kernel names, else this machine's default)")
    report.add_argument("--target", action="append", metavar="CHIP",
                        help="a chip to place the kernels on (v5e, h100, ...); repeat to "
                             "compare several (default: the backend's first chip)")
    report.add_argument("--out", metavar="FILE.html",
                        help="write the page of pictures (self-contained HTML) there")
    report.set_defaults(command="report")
    return parser, report


def _report(args: argparse.Namespace) -> int:
    import pallas_core as pl

    shapes = [parse_shape(s) for s in args.shapes]
    fn = load_function(args.function)
    _check_arity(fn, args.function, shapes)
    targets = args.target[0] if args.target and len(args.target) == 1 else args.target
    result = pl.report(fn, *shapes, backend=args.backend, target=targets)
    print(result)
    if args.out:
        print(f"wrote {result.save(args.out)}")
    return 0


def parse_shape(text: str) -> jax.ShapeDtypeStruct:
    """``bf16[4096,4096]`` -> ``jax.ShapeDtypeStruct((4096, 4096), bfloat16)``."""
    import jax.numpy as jnp

    found = _SHAPE.match(text)
    if found is None:
        raise ArgumentError(f"shape {text!r}: expected {_SHAPE_HELP}. Fix: write it as "
                            "DTYPE[...] with the sizes in brackets, separated by commas.")
    name, dims = found.group(1), found.group(2)
    try:
        dtype = jnp.dtype(_DTYPES.get(name, name))
    except TypeError:
        raise ArgumentError(f"shape {text!r}: {name!r} is not a dtype. Fix: use one of "
                            f"{', '.join(_DTYPES)}, or a NumPy name such as float32."
                            ) from None
    sizes = tuple(int(d) for d in dims.split(",")) if dims else ()
    return jax.ShapeDtypeStruct(sizes, dtype)


def load_function(spec: str) -> Callable[..., Any]:
    """The function ``spec`` (``pkg.module:function``, or ``pkg.module:Class.method``) names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ArgumentError(f"{spec!r}: expected MODULE:FUNCTION (e.g. "
                            "examples.report_matmul:matmul). Fix: put a colon between the "
                            "module's dotted name and the function's name.")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as ``python -m`` does
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ArgumentError(
                f"{spec!r}: no module named {missing!r} (looked in the current directory "
                f"{os.getcwd()!r} and the installed packages). Fix: run from the folder that "
                "holds it, install it, or check the spelling.") from None
        raise ArgumentError(f"{spec!r}: importing {module_name!r} failed: {e}. Fix: install "
                            f"{missing!r}, which the module imports.") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            public = sorted(n for n, v in vars(module).items()
                            if callable(v) and not n.startswith("_"))
            raise ArgumentError(
                f"{spec!r}: module {module_name!r} has no {attr!r}. Fix: name one of its "
                f"functions: {', '.join(public[:12]) or '(none)'}.")
        target = getattr(target, part)
    if not callable(target):
        raise ArgumentError(f"{spec!r}: expected a function, found a "
                            f"{type(target).__name__}. Fix: name a function of the module.")
    return target  # type: ignore[no-any-return]


def _check_arity(fn: Callable[..., Any], spec: str, shapes: list[Any]) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        return
    try:
        signature.bind(*shapes)
    except TypeError as e:
        raise ArgumentError(
            f"{spec!r}: {len(shapes)} shape(s) given for "
            f"{getattr(fn, '__name__', spec)}({', '.join(_positional(signature))}): {e}. Fix: "
            "give one SHAPE per positional argument, e.g. 'bf16[4096,4096]'.") from None


def _positional(signature: inspect.Signature) -> list[str]:
    """The parameters shapes are given for (keyword-only ones keep their defaults)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
             inspect.Parameter.VAR_POSITIONAL)
    return [name for name, p in signature.parameters.items() if p.kind in kinds]


def backend_listing() -> dict[str, Any]:
    """What ``python -m pallas_core --json`` prints: the versions, then each installed backend
    (``version``, ``package``, ``platforms``, ``default_for``, ``capabilities``), those
    skipped (name -> the variable that skipped it) and those that failed to load (name ->
    the error)."""
    backends = {}
    for name, b in sorted(manager.backends().items()):
        info = b.info
        backends[name] = {
            "version": info.version, "package": info.package or None,
            "platforms": list(info.platforms), "default_for": list(info.default_for),
            "capabilities": sorted(str(getattr(c, "value", c)) for c in info.capabilities)}
    return {
        "pallas_core": __version__, "jax": jax.__version__,
        "default_platform": jax.default_backend(), "backends": backends,
        "skipped": {n: str(r) for n, r in sorted(manager.skipped().items())},
        "errors": {n: str(e) for n, e in sorted(manager.errors().items())}}


def _backends_json() -> int:
    listing = backend_listing()
    print(json.dumps(listing, indent=2))
    return 1 if listing["errors"] else 0


def _backends() -> int:
    """Prints the installed backends and any that failed to load."""
    print(f"pallas-core {__version__} (jax {jax.__version__}, default platform "
          f"{jax.default_backend()})")
    backends = manager.backends()
    skipped = manager.skipped()
    if not backends and not skipped:
        print("no backends installed. Fix: pip install pallas-interpret")
    for name, b in sorted(backends.items()):
        info = b.info
        default = f", default on {', '.join(info.default_for)}" if info.default_for else ""
        caps = ""
        if info.capabilities:
            caps = f"\n    capabilities: {', '.join(sorted(info.capabilities))}"
        print(f"  {name:<12} {info.version:<10} {info.package or '?':<20} platforms: "
              f"{', '.join(info.platforms)}{default}{caps}")
    for name, reason in sorted(skipped.items()):
        print(f"  {name:<12} not loaded: {reason} is set")
    errors = manager.errors()
    for name, err in sorted(errors.items()):
        print(f"  {name:<12} FAILED TO LOAD: {err}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
