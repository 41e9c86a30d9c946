"""``pl.autotune``: choose a kernel's tunables (block sizes, warps, stages, ...) by pruning a
space without compiling, ranking the rest by a cost model, checking results on CPU when asked,
measuring the best on a device when one is attached, and caching the answer.

``build(**config)`` returns the function to run on ``*args``; each configuration of the space
goes through, in order:

1. **Pruning** (``pl.report``: traces, validates and counts; nothing is compiled, except
   Triton's on-chip footprint, which its compiler gives after the ``llir`` stage). A config is
   pruned when ``build`` or tracing raises a ``PallasError`` or ``ValueError`` (the backend's
   tiling and divisibility rules, the kernel's own shape checks), when the backend refuses a
   kernel (validation, noted by ``pl.report``), or when a kernel does not fit the chip's
   on-chip limit. Other exceptions propagate.
2. **Ranking** by :mod:`pallas_core.autotune_model` (roofline, tile waste, per-step overhead,
   pipeline fill and drain); ties go to fewer HBM bytes, then a smaller footprint.
3. **Checking** (``reference=``, off by default): the ``top_k`` best results against a
   reference on CPU (:mod:`pallas_core.autotune_measure`); a config that changes the answer is
   pruned ("wrong result") and the next one takes its place.
4. **Measuring** when a device of the backend's platform is attached (or ``measure=True``):
   the ``top_k`` best are compiled in parallel and timed, the winner re-timed against the
   runner-up; the fastest is chosen (``source == "measured"``). Else the model's first is
   (``source == "model"``).

Results are cached per configuration (:mod:`pallas_core.autotune_cache`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from pallas_core import autotune_measure as measure_
from pallas_core import autotune_model as model
from pallas_core.autotune_cache import Cache, canonical, fingerprint
from pallas_core.call import resolve_backend, unvalidated
from pallas_core.chips import backend_of_target, target_chip
from pallas_core.errors import ArgumentError, PallasError
from pallas_core.plugins import manager
from pallas_core.report import chips, report
from pallas_core.stages import kernel_calls
from pallas_core.units import nbytes, seconds

Config = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration of the space and what became of it (``row["config"]`` works too)."""

    config: Mapping[str, Any]
    verdict: str
    """``"pruned"``, ``"ranked"`` (kept, timed by the model only) or ``"measured"``."""
    reason: str = ""
    """Why it was pruned (or a remark on a kept one)."""
    predicted_seconds: float | None = None
    measured_seconds: float | None = None
    hbm_bytes: int | None = None
    onchip_bytes: int | None = None
    bound: str = ""
    """``"compute"`` or ``"memory"`` on the target (``"mixed"`` over several kernels)."""
    terms: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """The model's terms (seconds): ``roofline``, ``tile waste``, ``idle cores``, ``step overhead``,
    ``fill and drain``."""
    cached: bool = False
    """Whether this call found it in the cache (nothing was traced for it)."""

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)


@dataclasses.dataclass(frozen=True)
class AutotuneResult:
    """What ``pl.autotune`` chose and why; calling it runs the tuned function."""

    best: Config
    """The chosen configuration."""
    table: tuple[Row, ...]
    """Every configuration: measured ones (fastest first), then ranked ones (by predicted
    time), then pruned ones (in the space's order)."""
    source: str
    """``"measured"`` (timed on a device) or ``"model"`` (the cost model's ranking)."""
    fn: Callable[..., Any]
    """``build(**best)``: the tuned function."""
    backend: str
    target: str | None
    notes: tuple[str, ...] = ()
    evaluated: int = 0
    """Configurations evaluated by this call (the others came from the cache)."""
    seconds: float = 0.0
    """How long this call took."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __str__(self) -> str:
        return _describe(self)


# --- the space ---------------------------------------------------------------------------------


def configs_of(space: Any, constraints: Any = None) -> list[Config]:
    """The configurations of ``space`` (a list of dicts, or a dict of lists whose product is
    taken, in order), those for which a constraint returns False left out, duplicates once."""
    if isinstance(space, Mapping):
        for name, choices in space.items():
            if isinstance(choices, (str, bytes, Mapping)) or not isinstance(choices, Iterable):
                raise ArgumentError(
                    f"pl.autotune(space=...): expected a list of choices for {name!r}, found "
                    f"{choices!r}. Fix: write {name}=[{choices!r}] for a single choice.")
        names = list(space)
        found = [dict(zip(names, values, strict=True))
                 for values in itertools.product(*(list(space[n]) for n in names))]
    elif isinstance(space, Sequence) and not isinstance(space, (str, bytes)) and all(
            isinstance(c, Mapping) for c in space):
        found = [dict(c) for c in space]
    else:
        raise ArgumentError(
            f"pl.autotune(space=...): expected a list of config dicts or a dict of lists of "
            f"choices, found {space!r}. Fix: e.g. space={{'bm': [128, 256], 'bk': [512]}}.")
    rules = [] if constraints is None else (
        [constraints] if callable(constraints) else list(constraints))
    for rule in rules:
        if not callable(rule):
            raise ArgumentError(f"pl.autotune(constraints=...): expected a function of a "
                                f"config returning a bool, found {rule!r}.")
    unique: dict[str, Config] = {}
    for c in found:
        if all(rule(c) for rule in rules):
            unique.setdefault(canonical(c), c)
    if not unique:
        raise ArgumentError(
            "pl.autotune: the space has no configuration"
            + (" its constraints allow" if rules else "") + ". Fix: add choices"
            + (", or loosen the constraints." if rules else "."))
    return list(unique.values())


def _signature(args: Sequence[Any]) -> str:
    parts = []
    for a in args:
        shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
        if shape is None or dtype is None:
            parts.append(repr(a))
        else:
            parts.append(f"{jax.numpy.dtype(dtype).name}[{','.join(map(str, shape))}]")
    return ",".join(parts)


def _abstract(args: Sequence[Any]) -> list[Any]:
    """Traced values (the tuned function called under ``jax.jit``) as shapes and dtypes."""
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) if isinstance(a, jax.core.Tracer) else a
            for a in args]


def _name(build: Callable[..., Any]) -> str:
    inner = build.func if isinstance(build, functools.partial) else build
    return f"{getattr(inner, '__module__', '')}.{getattr(inner, '__qualname__', type(inner))}"


# --- one configuration -------------------------------------------------------------------------


class _PrunedError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _trace(build: Callable[..., Any], config: Config, args: Sequence[Any], backend: str | None,
           target: str | None) -> tuple[Callable[..., Any], Any]:
    """``build(**config)`` and its jaxpr on ``args`` (validation left to ``pl.report``)."""
    try:
        fn = build(**config)
    except (PallasError, ValueError) as e:
        raise _PrunedError(f"build raised {type(e).__name__}: {e}") from e
    if not callable(fn):
        raise ArgumentError(f"pl.autotune: build(**{config!r}) returned {fn!r}; expected the "
                            "function to run on the arguments. Fix: return it from build.")
    owner = backend or (backend_of_target(target) if target is not None else None)
    own = target if owner and target in manager.get(owner).info.device_kinds else None
    try:
        with target_chip(owner, own), unvalidated():
            return fn, jax.make_jaxpr(fn)(*args)
    except (PallasError, ValueError) as e:
        raise _PrunedError(f"tracing raised {type(e).__name__}: {e}") from e


_MEASURED = ("measured_seconds", "measured_on", "verified")
"""What a record keeps when its prediction is made again by a newer model."""


def _current(record: dict[str, Any] | None) -> bool:
    """Whether a cached record needs no new evaluation: a pruned one (pruning does not
    depend on the cost model), or a prediction by this version of the model."""
    return record is not None and (record["verdict"] == "pruned"
                                   or record.get("model") == model.VERSION)


def _evaluate(build: Callable[..., Any], config: Config, args: Sequence[Any],
              backend: str | None, target: str | None) -> dict[str, Any]:
    """The cache record of one configuration: pruned with its reason, or its prediction."""
    try:
        fn, closed = _trace(build, config, args, backend, target)
        rep = report(fn, *args, backend=backend, target=target)
    except _PrunedError as e:
        return {"verdict": "pruned", "reason": e.reason}
    except (PallasError, ValueError) as e:
        return {"verdict": "pruned", "reason": f"pl.report raised {type(e).__name__}: {e}"}
    for k in rep.kernels:
        refusal = next((n for n in k.notes
                        if n.startswith(f"the {k.backend} backend refuses this kernel")), None)
        if refusal is not None:
            return {"verdict": "pruned", "reason": refusal}
        if k.fits is False:
            return {"verdict": "pruned", "reason": (
                f"kernel {k.name!r} needs {nbytes(k.onchip_bytes or 0)} on chip, over its "
                f"limit of {nbytes(k.onchip_limit or 0)}")}
    reason = "" if rep.kernels else "no kernel: nothing to tune"
    named = rep.kernels[0].backend if rep.kernels else backend
    note = ""
    if named and manager.get(named).info.chips and any(
            k.onchip_bytes is None for k in rep.kernels):
        note = (f"the {named} backend gave no on-chip footprint"
                + (" (it needs the triton package: pallas-triton[compile])"
                   if named == "triton" else "") + ": configs were not pruned by it")
    if target is None and rep.kernels:  # the first chip of the kernel's backend
        target = next(iter(rep.kernels[0].roofline), None)
    chip = chips()[target][1] if target is not None else None
    calls = list(kernel_calls(closed.jaxpr))
    found = model.predict(rep.kernels, calls, target, chip)
    return {"verdict": "ranked", "reason": reason, "note": note, "backend": named,
            "model": model.VERSION,
            "target": target,
            "predicted_seconds": found.seconds, "hbm_bytes": found.hbm_bytes,
            "onchip_bytes": found.onchip_bytes, "bound": found.bound,
            "terms": dict(found.terms)}


def _rank_key(item: tuple[int, dict[str, Any]]) -> tuple[Any, ...]:
    n, r = item
    p = r.get("predicted_seconds")
    return (p is None, p or 0.0, r.get("hbm_bytes") or 0, r.get("onchip_bytes") or 0, n)


# --- the progress line -------------------------------------------------------------------------


class _Progress:
    """One line on stderr, rewritten in place; silent unless stderr is a terminal."""

    def __init__(self, enabled: bool | None, total: int) -> None:
        self.on = sys.stderr.isatty() if enabled is None else enabled
        self.total = total
        self.shown = False

    def show(self, records: Sequence[dict[str, Any] | None], best: Config | None) -> None:
        if not self.on:
            return
        done = [r for r in records if r is not None]
        counts = {v: sum(r["verdict"] == v for r in done) for v in ("pruned", "ranked")}
        measured = sum(r.get("measured_seconds") is not None for r in done)
        line = (f"\rpl.autotune: {len(done)}/{self.total} evaluated, {counts['pruned']} "
                f"pruned, {counts['ranked']} ranked, {measured} measured"
                + (f"; best so far {canonical(best)}" if best is not None else ""))
        sys.stderr.write(line[:160].ljust(100))
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


# --- the call ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Options:
    backend: str | None = None
    target: str | None = None
    cache: Any = None
    key: Any = None
    top_k: int = 5
    measure: bool | None = None
    reference: Any = None
    constraints: Any = None
    runs: int = 10
    progress: bool | None = None


def _backend_and_target(options: _Options) -> tuple[str | None, str | None]:
    """The backend named (``None``: each kernel's own, as ``pl.report`` does) and the chip
    (default: the named backend's first)."""
    known = chips()
    target = options.target
    if target is not None and (not isinstance(target, str) or target not in known):
        raise ArgumentError(f"pl.autotune(target={target!r}): expected a chip a loaded "
                            f"backend lists. Fix: use one of {sorted(known)}.")
    backend = None
    if options.backend is not None:
        backend = resolve_backend(options.backend, None, False) or options.backend
        if target is None:
            target = next(iter(getattr(manager.get(backend).info, "chips", {})), None)
    return backend, target


def _resolved(backend: str | None, records: Sequence[dict[str, Any] | None]) -> str:
    """The backend the kernels run on: the one named, else the first kernel's."""
    if backend is not None:
        return backend
    named = next((r.get("backend") for r in records if r is not None and r.get("backend")),
                 None)
    return named or manager.default_for_platform(jax.default_backend())


_FINGERPRINTS: dict[tuple[Any, ...], tuple[Any, str | None]] = {}
"""Fingerprints computed in this process, by ``(id(build), config, signature, backend,
target)``; the value keeps ``build`` alive so that its id is not reused. As ``jax.jit`` traces
a function object once per signature, a build is traced for its fingerprint once."""


def _entry(cache: Cache, partial: str, build: Callable[..., Any], configs: Sequence[Config],
           args: Sequence[Any], backend: str | None, target: str | None
           ) -> dict[str, Any] | None:
    """The cache entry of this kernel: an existing one whose fingerprinting config is in the
    space and still traces to the same jaxpr, else a new one fingerprinted on the first
    config that traces (``None`` when none does: nothing is cached)."""
    by_text = {canonical(c): c for c in configs}
    sig = _signature(args)

    def print_of(text: str) -> str | None:
        memo = (id(build), text, sig, backend, target)
        if memo not in _FINGERPRINTS:
            try:
                found = fingerprint(str(_trace(build, by_text[text], args, backend,
                                               target)[1]))
            except _PrunedError:
                found = None
            if len(_FINGERPRINTS) >= 1024:
                _FINGERPRINTS.pop(next(iter(_FINGERPRINTS)))
            _FINGERPRINTS[memo] = (build, found)
        return _FINGERPRINTS[memo][1]

    for _, entry in cache.candidates(partial):
        text = entry.get("fingerprint_config")
        if text in by_text and print_of(text) == entry.get("fingerprint"):
            return entry
    for text, config in by_text.items():
        found = print_of(text)
        if found is not None:
            return cache.entry(partial, found, config)
    return None


def tune(build: Callable[..., Any], space: Any, args: Sequence[Any],
         options: _Options) -> AutotuneResult:
    """``pl.autotune``'s function form (see :func:`autotune`)."""
    start = time.perf_counter()
    if not callable(build):
        raise ArgumentError(f"pl.autotune: expected build, a function of the config's "
                            f"keywords returning the function to run; found {build!r}.")
    if not isinstance(options.top_k, int) or options.top_k < 1:
        raise ArgumentError(f"pl.autotune(top_k={options.top_k!r}): expected a positive int.")
    configs = configs_of(space, options.constraints)
    backend, target = _backend_and_target(options)
    args = _abstract(args)
    sig = canonical(options.key(*args)) if callable(options.key) else (
        _signature(args) if options.key is None else canonical(options.key))
    cache = Cache(options.cache)
    entry = _entry(cache, Cache.key(backend, target, _name(build), sig), build, configs, args,
                   backend, target)
    stored: dict[str, Any] = entry["configs"] if entry is not None else {}
    before = canonical(stored)
    progress = _Progress(options.progress, len(configs))
    notes: list[str] = []
    records: list[dict[str, Any] | None] = []
    cached: list[bool] = []
    evaluated = 0
    try:
        for config in configs:
            text = canonical(config)
            old = stored.get(text)
            cached.append(_current(old))
            if not _current(old):
                stored[text] = _evaluate(build, config, args, backend, target)
                if old is not None and stored[text]["verdict"] != "pruned":
                    stored[text].update({k: old[k] for k in _MEASURED if k in old})
                evaluated += 1
            records.append(stored[text])
            if progress.on:
                progress.show(records, _model_best(configs, records))
        # Under jax.jit (the decorator form), the inputs and runs below are concrete.
        runs_on = _resolved(backend, records)
        with jax.ensure_compile_time_eval():
            if options.reference is not None:
                notes += _check(build, configs, records, args, runs_on, target, options)
            source, measured = _measure(build, configs, records, args, runs_on, target,
                                        options, progress)
        notes += measured
    finally:
        progress.close()
    if entry is None:
        if options.cache is not None:
            notes.append("no configuration traces: nothing was cached")
    elif canonical(stored) != before:
        why = cache.save()
        if why:
            notes.append(why)
    target = target or next((r.get("target") for r in records if r and r.get("target")), None)
    return _result(build, configs, records, cached, source, runs_on, target, notes, evaluated,
                   time.perf_counter() - start)


def _model_best(configs: Sequence[Config], records: Sequence[dict[str, Any] | None]
                ) -> Config | None:
    kept = [(n, r) for n, r in enumerate(records) if r is not None and r["verdict"] != "pruned"]
    return configs[min(kept, key=_rank_key)[0]] if kept else None


def _ranked(records: Sequence[dict[str, Any] | None]) -> list[int]:
    kept = [(n, r) for n, r in enumerate(records) if r is not None and r["verdict"] != "pruned"]
    return [n for n, _ in sorted(kept, key=_rank_key)]


def _check(build: Callable[..., Any], configs: Sequence[Config],
           records: list[dict[str, Any] | None], args: Sequence[Any], backend: str,
           target: str | None, options: _Options) -> list[str]:
    """Checks the best ``top_k`` kept configs' results against the reference, pruning each
    that differs ("wrong result") and taking the next. Configs checked before (the cache
    says ``verified``) are not run again, nor is the reference when none needs checking."""
    reference = options.reference
    if not (reference == "first" or callable(reference)):
        raise ArgumentError(f"pl.autotune(reference={reference!r}): expected a function of "
                            "the arguments or \"first\". Fix: pass one, or None.")
    todo = []
    for n in _ranked(records)[:options.top_k]:
        if not records[n].get("verified"):  # type: ignore[union-attr]
            todo.append(n)
    if not todo:
        return []
    inputs = measure_.concrete_inputs(args)
    if reference == "first":
        first = next(n for n, r in enumerate(records) if r is not None
                     and r["verdict"] != "pruned")
        run, why = measure_.cpu_runner(build(**configs[first]), backend, target)
        label = f"the first kept config {canonical(configs[first])}"
    else:
        run, why, label = jax.jit(reference), "", "the reference function"
    if run is None:
        return [why]
    expected = run(*inputs)
    ranked, passed = _ranked(records), 0
    for n in ranked:
        record = records[n]
        assert record is not None
        if passed >= options.top_k:
            break
        if not record.get("verified"):
            got, why = measure_.cpu_runner(build(**configs[n]), backend, target)
            if got is None:
                return [why]
            wrong = measure_.differs(got(*inputs), expected)
            if wrong:
                record.update(verdict="pruned", reason=f"wrong result against {label}: {wrong}")
                continue
            record["verified"] = True
        passed += 1
    return []


def _measure(build: Callable[..., Any], configs: Sequence[Config],
             records: list[dict[str, Any] | None], args: Sequence[Any], backend: str,
             target: str | None, options: _Options, progress: _Progress
             ) -> tuple[str, list[str]]:
    """Times the best ``top_k`` kept configs where a device runs them; returns the source of
    the decision and notes."""
    platforms = manager.get(backend).info.platforms
    platform = measure_.device_platform()
    runs_here = measure_.platform_matches(platform, platforms)
    if options.measure is False or (options.measure is None and (
            platform == "cpu" or not runs_here)):
        why = ("measure=False" if options.measure is False else
               f"no device the {backend} backend runs on is attached (the default device is "
               f"{platform})")
        return "model", [f"{why}: the model's ranking decided (predicted, not measured)"]
    if not runs_here:
        raise ArgumentError(
            f"pl.autotune(measure=True): the {backend} backend runs on {list(platforms)}, and "
            f"the attached device is {platform}. Fix: leave measure=None to rank by the "
            "model, or run where such a device is attached.")
    kind = jax.devices()[0].device_kind
    top = _ranked(records)[:options.top_k]
    todo = [n for n in top if records[n].get("measured_on") != kind]  # type: ignore[union-attr]
    notes: list[str] = []
    if todo:
        inputs = measure_.concrete_inputs(args)
        compiled = measure_.compile_all([build(**configs[n]) for n in todo], inputs)
        flush = measure_.Flusher(model.CPU_FLUSH_BYTES if platform == "cpu"
                                 else model.overheads(target).llc_bytes)
        samples: dict[int, list[float]] = {}
        for n, c in zip(todo, compiled, strict=True):
            record = records[n]
            assert record is not None
            if isinstance(c, Exception):
                record.update(verdict="pruned", reason=(
                    f"refused when compiled for {kind} ({type(c).__name__}: {c}); the pruner "
                    "had kept it"))
                notes.append(f"{canonical(configs[n])} was kept by the pruner but did not "
                             "compile: the pruner and the compiler disagree")
                continue
            samples[n] = measure_.time_runs(c, inputs, flush, options.runs)
            record.update(measured_seconds=measure_.median(samples[n]), measured_on=kind)
            if progress.on:
                progress.show(records, configs[min(samples, key=lambda m: measure_.median(
                    samples[m]))])
        _remeasure(samples, dict(zip(todo, compiled, strict=True)), inputs, flush, records,
                   options.runs)
    if not any(r is not None and r.get("measured_on") == kind and r["verdict"] != "pruned"
               for r in records):
        return "model", [*notes, "no candidate could be measured: the model's ranking decided"]
    return "measured", notes


def _remeasure(samples: dict[int, list[float]], compiled: Mapping[int, Any],
               inputs: Sequence[Any], flush: measure_.Flusher,
               records: list[dict[str, Any] | None], runs: int) -> None:
    """Times the winner and the runner-up again, alternating, and keeps the median of all
    their runs: the winner is accepted only if it still wins (noise has picked the worst
    config in other tuners)."""
    if len(samples) < 2:
        return
    first, second = sorted(samples, key=lambda n: measure_.median(samples[n]))[:2]
    for _ in range(runs):
        for n in (first, second):
            samples[n] += measure_.time_runs(compiled[n], inputs, flush, 1, warmup=0)
    for n in (first, second):
        record = records[n]
        assert record is not None
        record["measured_seconds"] = measure_.median(samples[n])


def _result(build: Callable[..., Any], configs: Sequence[Config],
            records: Sequence[dict[str, Any] | None], cached: Sequence[bool], source: str,
            backend: str, target: str | None, notes: list[str], evaluated: int,
            took: float) -> AutotuneResult:
    kind = jax.devices()[0].device_kind
    rows = []
    for n, (config, r) in enumerate(zip(configs, records, strict=True)):
        assert r is not None
        timed = r.get("measured_seconds") if r.get("measured_on") == kind else None
        verdict = r["verdict"]
        if verdict != "pruned" and source == "measured" and timed is not None:
            verdict = "measured"
        rows.append((n, Row(config=config, verdict=verdict, reason=r.get("reason", ""),
                            predicted_seconds=r.get("predicted_seconds"),
                            measured_seconds=timed if verdict == "measured" else None,
                            hbm_bytes=r.get("hbm_bytes"), onchip_bytes=r.get("onchip_bytes"),
                            bound=r.get("bound", ""), terms=r.get("terms", {}),
                            cached=cached[n])))
    measured = sorted((x for x in rows if x[1].verdict == "measured"),
                      key=lambda x: (x[1].measured_seconds, x[0]))
    ranked = [(n, rows[n][1]) for n in _ranked(records) if rows[n][1].verdict == "ranked"]
    pruned = [x for x in rows if x[1].verdict == "pruned"]
    order = [row for _, row in measured + ranked + pruned]
    if not measured and not ranked:
        reasons = "; ".join(f"{canonical(r.config)}: {r.reason[:200]}" for r in order[:3])
        raise ArgumentError(
            f"pl.autotune: every configuration of the space was pruned ({len(order)}; the "
            f"first: {reasons}). Fix: add configurations the backend accepts (smaller blocks, "
            "or compiler params with a larger on-chip limit).")
    best = order[0].config
    notes += [r["note"] for r in records if r is not None and r.get("note")]
    return AutotuneResult(best=dict(best), table=tuple(order), source=source,
                          fn=build(**best), backend=backend, target=target,
                          notes=tuple(dict.fromkeys(notes)), evaluated=evaluated, seconds=took)


def _describe(r: AutotuneResult) -> str:
    counts = {v: sum(row.verdict == v for row in r.table)
              for v in ("pruned", "ranked", "measured")}
    decided = ("measurement on the device" if r.source == "measured"
               else "the model (not measured)")
    lines = [f"pl.autotune on {r.backend}" + (f" for {r.target}" if r.target else "")
             + f": {len(r.table)} configs, {counts['pruned']} pruned, {counts['ranked']} "
             f"ranked, {counts['measured']} measured ({r.evaluated} evaluated, "
             f"{len(r.table) - r.evaluated} from the cache, {seconds(r.seconds)})",
             f"best: {canonical(r.best)}, decided by {decided}"]
    rows = [("config", "verdict", "predicted", "measured", "bound", "HBM bytes", "reason")]
    for row in r.table:
        rows.append((" ".join(f"{k}={v}" for k, v in row.config.items()), row.verdict,
                     seconds(row.predicted_seconds) if row.predicted_seconds is not None
                     else "-",
                     seconds(row.measured_seconds) if row.measured_seconds is not None
                     else "-", row.bound or "-",
                     nbytes(row.hbm_bytes) if row.hbm_bytes is not None else "-",
                     row.reason if len(row.reason) <= 90 else row.reason[:87] + "..."))
    widths = [max(len(x[c]) for x in rows) for c in range(len(rows[0]))]
    table = ["  " + "  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip()
             for x in rows]
    table.insert(1, "  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines + table + [f"note: {n}" for n in r.notes])


# --- the public name ---------------------------------------------------------------------------


class Autotuned:
    """A kernel builder tuned on first call for each argument signature (shapes and dtypes,
    or ``key(*args)``), then run with the best config (``pl.autotune``'s decorator form)."""

    def __init__(self, build: Callable[..., Any], space: Any, options: _Options) -> None:
        self.build, self.space, self.options = build, space, options
        self.results: dict[str, AutotuneResult] = {}
        """Tuned results by argument signature."""
        functools.update_wrapper(self, build)

    def tune(self, *args: Any) -> AutotuneResult:
        """The result for ``args`` (tuned now unless tuned before in this process)."""
        abstract = _abstract(args)
        sig = (canonical(self.options.key(*abstract)) if callable(self.options.key)
               else _signature(abstract))
        if sig not in self.results:
            self.results[sig] = tune(self.build, self.space, abstract, self.options)
        return self.results[sig]

    def __call__(self, *args: Any) -> Any:
        return self.tune(*args)(*args)


def autotune(build: Callable[..., Any] | None = None, space: Any = None, *args: Any,
             backend: str | None = None, target: str | None = None, cache: Any = None,
             key: Any = None, top_k: int = 5, measure: bool | None = None,
             reference: Any = None, constraints: Any = None, runs: int = 10,
             progress: bool | None = None) -> Any:
    """Tunes ``build``'s keyword arguments over ``space`` for ``args``.

    Function form: ``pl.autotune(build, space, *args, backend=..., target=..., cache=PATH)``
    returns an :class:`AutotuneResult` (``best``, ``table``, ``source``; calling it runs
    ``build(**best)``). Decorator form: ``@pl.autotune(space=..., backend=..., target=...)``
    over ``build`` gives a function that tunes on its first call for each argument signature,
    then runs the best config. See ``docs/autotune.md``.

    :param build: ``build(**config)`` returns the function to run on ``*args``.
    :param space: a list of config dicts, or a dict of lists of choices (their product).
    :param args: the arguments, arrays or ``jax.ShapeDtypeStruct``s.
    :param backend: the backend that compiles the kernels (default: each kernel's own, as
        ``pl.report`` chooses).
    :param target: the chip to rank for (default: the backend's first chip).
    :param cache: a JSON file of results, read and (where writable) updated.
    :param key: what a tuned answer is valid for: ``None`` (the arguments' shapes and dtypes),
        a function of the arguments, or a JSON-able value.
    :param top_k: how many of the best-ranked configs are checked and measured.
    :param measure: ``None``: measure when a device of the backend's platform is attached;
        ``True``: measure (on the CPU too, for a backend that runs there); ``False``: never.
    :param reference: ``None``, a function of the arguments, or ``"first"`` (the first config
        the pruner keeps): the ``top_k`` best configs' results are checked against it on CPU.
    :param constraints: a function of a config (or a list of them) returning False for a
        combination to leave out of the space.
    :param runs: timed runs per measured config.
    :param progress: a progress line on stderr (default: when stderr is a terminal).
    """
    options = _Options(backend=backend, target=target, cache=cache, key=key, top_k=top_k,
                       measure=measure, reference=reference, constraints=constraints, runs=runs,
                       progress=progress)
    if build is None:
        if space is None:
            raise ArgumentError("pl.autotune: expected space=... (a list of config dicts or a "
                                "dict of lists). Fix: @pl.autotune(space={'block': [128]}).")
        return lambda fn: Autotuned(fn, space, options)
    if space is None:
        raise ArgumentError("pl.autotune(build, space, *args): expected a space (a list of "
                            "config dicts or a dict of lists of choices), found None.")
    if not args:
        return Autotuned(build, space, options)
    return tune(build, space, args, options)
