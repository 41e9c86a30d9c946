"""``pl.autotune`` (issue 32, first part): pruning that agrees with the lowering, the model's
choice for the seed's 4096^3 bfloat16 matmul on v5e, the cache, the decorator form,
measuring (the interpreter's runs on the CPU) and checking results against a reference."""

from __future__ import annotations

import functools
import importlib
import json
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from pallas_core import autotune_measure
from pallas_core.plugins import manager
from pallas_core.stages import kernel_calls

autotune_module = importlib.import_module("pallas_core.autotune")  # pl.autotune hides it
N = 4096
A = jax.ShapeDtypeStruct((N, N), jnp.bfloat16)
BLOCKS = [128, 256, 512, 1024, 2048]
SPACE = {"bm": BLOCKS, "bn": BLOCKS, "bk": BLOCKS}


def build_matmul(bm: int, bn: int, bk: int) -> Any:
    """The seed's blocked matmul (``examples/report_matmul.py``) with these blocks."""
    from examples.report_matmul import matmul

    return functools.partial(matmul, bm=bm, bn=bn, bk=bk)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: Any) -> tuple[pl.AutotuneResult, Any, float]:
    """The first call, with a fresh cache: (result, cache path, seconds)."""
    pytest.importorskip("pallas_mosaic_tpu")
    path = tmp_path_factory.mktemp("autotune") / "tuned.json"
    start = time.perf_counter()
    result = pl.autotune(build_matmul, SPACE, A, A, backend="mosaic_tpu", target="v5e",
                         cache=path)
    return result, path, time.perf_counter() - start


def _lowers(config: dict[str, int]) -> str:
    """``""`` when the config lowers for the TPU on this CPU, else the refusal."""
    try:
        pl.stages(build_matmul(**config), A, A, backend="mosaic_tpu", target="v5e")[0]["mosaic"]
    except pl.PallasError as e:
        return str(e)
    return ""


def test_the_pruner_and_the_lowering_agree_on_every_config(tuned: Any) -> None:
    """Each of the 125 configs is lowered: those kept lower, those pruned are refused, and
    for the same reason (the VMEM they need over the 16 MiB default limit)."""
    result, _, _ = tuned
    assert len(result.table) == 125
    kept = [r for r in result.table if r.verdict != "pruned"]
    pruned = [r for r in result.table if r.verdict == "pruned"]
    assert kept and pruned
    assert [r.config for r in kept if _lowers(dict(r.config))] == []
    for r in pruned:
        refusal = _lowers(dict(r.config))
        assert refusal, f"{r.config} was pruned ({r.reason}) but lowers"
        assert "MiB of VMEM" in refusal and "MiB of VMEM" in r.reason
        needed = refusal.split(" needs ")[1].split(" of VMEM")[0]
        assert needed in r.reason  # the same figure
        (k,) = pl.report(build_matmul(**r.config), A, A, backend="mosaic_tpu",
                         target="v5e").kernels
        assert k.fits is False and k.onchip_bytes > 16 * 2**20


def test_the_models_choice_is_compute_bound_and_fits(tuned: Any) -> None:
    """1024^3 blocks: each A and B block is fetched 4 times (288 MiB, 352 us of HBM time
    against 698 us of MXU time), 64 grid steps, and the buffers take exactly the 16 MiB
    default limit. Configs with 128 steps pay 22 us more in step overhead."""
    result, _, _ = tuned
    assert result.source == "model"
    assert result.best == {"bm": 1024, "bn": 1024, "bk": 1024}
    best = result.table[0]
    assert best.config == result.best and best.verdict == "ranked"
    assert best.bound == "compute"
    (k,) = pl.report(result.fn, A, A, backend="mosaic_tpu", target="v5e").kernels
    assert k.roofline["v5e"].bound == "compute"
    assert k.fits is True and k.onchip_bytes <= k.onchip_limit == 16 * 2**20
    assert best.predicted_seconds == pytest.approx(sum(best.terms.values()))
    assert best.terms["step overhead"] == pytest.approx(64 * 0.35e-6)
    predicted = [r.predicted_seconds for r in result.table if r.verdict == "ranked"]
    assert predicted == sorted(predicted)
    assert "best:" in str(result) and "bm=1024 bn=1024 bk=1024" in str(result)
    assert any("not measured" in n for n in result.notes)


def _count(monkeypatch: Any) -> dict[str, int]:
    counts = {"report": 0, "lowered": 0, "footprint": 0, "traced": 0}
    report, call_hook, trace = autotune_module.report, manager.call_hook, autotune_module._trace

    def counted_report(*a: Any, **k: Any) -> Any:
        counts["report"] += 1
        return report(*a, **k)

    def counted_hook(backend: str, hook: str, **k: Any) -> Any:
        if hook in ("pallas_lower", "pallas_emulate"):
            counts["lowered"] += 1
        counts["footprint"] += hook == "pallas_footprint"
        return call_hook(backend, hook, **k)

    def counted_trace(*a: Any, **k: Any) -> Any:
        counts["traced"] += 1
        return trace(*a, **k)

    monkeypatch.setattr(autotune_module, "report", counted_report)
    monkeypatch.setattr(manager, "call_hook", counted_hook)
    monkeypatch.setattr(autotune_module, "_trace", counted_trace)
    return counts


def test_a_second_call_is_cached(tuned: Any, monkeypatch: Any) -> None:
    result, path, first = tuned
    counts = _count(monkeypatch)
    start = time.perf_counter()
    again = pl.autotune(build_matmul, SPACE, A, A, backend="mosaic_tpu", target="v5e",
                        cache=path)
    took = time.perf_counter() - start
    assert counts == {"report": 0, "lowered": 0, "footprint": 0, "traced": 0}
    assert again.best == result.best and again.evaluated == 0
    assert all(r.cached for r in again.table)
    assert first >= 100 * took, (first, took)
    # As a new process would: the fingerprint is traced again, once (one config).
    monkeypatch.setattr(autotune_module, "_FINGERPRINTS", {})
    fresh = pl.autotune(build_matmul, SPACE, A, A, backend="mosaic_tpu", target="v5e",
                        cache=path)
    assert fresh.best == result.best and fresh.evaluated == 0
    assert counts == {"report": 0, "lowered": 0, "footprint": 0, "traced": 1}
    stored = json.loads(path.read_text())
    (entry,) = stored["entries"].values()
    assert len(entry["configs"]) == 125


def test_adding_a_config_evaluates_only_it(tuned: Any, monkeypatch: Any, tmp_path: Any) -> None:
    """A (512, 64) block of A breaks Mosaic TPU's tiling rule (the last dimension a multiple
    of 128): pruned by validation, without lowering, as the lowering refuses it."""
    _, path, _ = tuned
    copy = tmp_path / "tuned.json"
    copy.write_text(path.read_text())
    space = [*autotune_module.configs_of(SPACE), {"bm": 512, "bn": 512, "bk": 64}]
    counts = _count(monkeypatch)
    result = pl.autotune(build_matmul, space, A, A, backend="mosaic_tpu", target="v5e",
                         cache=copy)
    assert result.evaluated == 1 and counts["report"] == 1 and counts["lowered"] == 0
    (new,) = [r for r in result.table if not r.cached]
    assert new.verdict == "pruned" and "128" in new.reason
    assert _lowers({"bm": 512, "bn": 512, "bk": 64})


def test_a_newer_model_predicts_again_and_keeps_what_was_measured(
        tuned: Any, monkeypatch: Any, tmp_path: Any) -> None:
    """Records of another model version are predicted again (measured times kept); pruned
    ones and current ones are not evaluated again."""
    _, path, _ = tuned
    data = json.loads(path.read_text())
    (entry,) = data["entries"].values()
    kept = [c for c, r in entry["configs"].items() if r["verdict"] != "pruned"]
    old = entry["configs"][kept[0]]
    old.update(model=autotune_module.model.VERSION - 1, predicted_seconds=1.0,
               measured_seconds=2.5e-4, measured_on="TPU v5 lite")
    copy = tmp_path / "tuned.json"
    copy.write_text(json.dumps(data))
    counts = _count(monkeypatch)
    result = pl.autotune(build_matmul, SPACE, A, A, backend="mosaic_tpu", target="v5e",
                         cache=copy, measure=False)
    assert result.evaluated == 1 and counts["report"] == 1
    (row,) = [r for r in result.table if not r.cached]
    assert json.loads(autotune_module.canonical(dict(row.config))) == json.loads(kept[0])
    assert row.predicted_seconds is not None and row.predicted_seconds < 1e-2
    record = json.loads(copy.read_text())["entries"]
    (again,) = record.values()
    assert again["configs"][kept[0]]["measured_seconds"] == 2.5e-4
    assert again["configs"][kept[0]]["model"] == autotune_module.model.VERSION


def test_gpu_occupancy_and_idle_cores() -> None:
    """On an H100 (132 SMs; per SM 64 warps, 228 KiB, 32 blocks, 64K registers): how many
    programs an SM holds, the compute time stretched when a grid leaves SMs idle, and the
    floor of one round trip per wave."""
    model = autotune_module.model
    h100 = model.overheads("h100")
    assert model.resident(h100, 4, None) == 16          # 64 warps / 4
    assert model.resident(h100, 1, None) == 32          # the block slots
    assert model.resident(h100, 8, 100 * 1024) == 2     # 228 KiB / 100 KiB
    assert model.resident(h100, 32, 300 * 1024) == 1    # at least one
    assert model.resident(h100, 4, None, 128) == 4      # 65536 / (128 x 128 threads)
    assert model.warps_of({"triton": {"num_warps": 8}}) == 8 and model.warps_of(None) is None

    def add(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + y_ref[...]

    def run(programs: int) -> Any:
        x = jax.ShapeDtypeStruct((programs * 8, 512), jnp.float32)
        spec = pl.BlockSpec((8, 512), lambda i: (i, 0))
        fn = pl.pallas_call(add, grid=(programs,), in_specs=[spec, spec], out_specs=spec,
                            out_shape=x)
        (k,) = pl.report(fn, x, x, backend="triton", target="h100").kernels
        chip = sys.modules["pallas_core.report"].chips()["h100"][1]
        calls = list(kernel_calls(jax.make_jaxpr(fn)(x, x).jaxpr))
        return k, model.predict([k], calls, "h100", chip)

    # A block of 8 x 512 float32 over 128 threads: 32 words each, two such values live, plus
    # 32: 96 registers; 65536 / (96 x 128) = 5 programs per SM. One round trip per program.
    for programs in (8, 132, 3960):
        k, found = run(programs)
        line = k.roofline["h100"]
        stretch = -(-programs // 132) * 132 / programs
        busiest = max(line.compute_seconds * stretch, line.memory_seconds)
        assert found.terms["idle cores"] == pytest.approx(busiest - line.seconds)
        assert found.terms["register spills"] == 0.0
        waves = -(-programs // (132 * 5))
        assert found.terms["step overhead"] == pytest.approx(max(0.0, waves * 1e-6 - busiest))
        if programs == 8:  # a tiny kernel is bound by the floor: one round trip
            assert found.seconds == pytest.approx(1e-6 + found.terms["fill and drain"])
    assert stretch == 1.0 and found.terms["step overhead"] == 0.0  # 3960 programs: no floor


def test_gpu_round_trips_and_spills() -> None:
    """A loop of loads is as many round trips as its trips (a row reduction in 8 column
    blocks: 8 trips, plus the loads before it); a block too large for one warp's registers
    spills."""
    model = autotune_module.model

    def rows(block: int, warps: int) -> Any:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            def body(j: Any, acc: Any) -> Any:
                return acc + x_ref[:, pl.ds(j * block, block)]

            o_ref[...] = jax.lax.fori_loop(1, 4096 // block, body, x_ref[:, :block])

        x = jax.ShapeDtypeStruct((64 * 8, 4096), jnp.float32)
        fn = pl.pallas_call(kernel, grid=(64,), out_shape=jax.ShapeDtypeStruct((512, block),
                                                                                jnp.float32),
                            in_specs=[pl.BlockSpec((8, 4096), lambda i: (i, 0))],
                            out_specs=pl.BlockSpec((8, block), lambda i: (i, 0)),
                            compiler_params={"triton": {"num_warps": warps}})
        (call,) = kernel_calls(jax.make_jaxpr(fn)(x).jaxpr)
        return model.gpu_program(call, model.overheads("h100"))

    small = rows(512, 4)
    assert small.rounds == 1 + 4096 // 512 - 1
    assert small.registers == 32 + 2 * (8 * 512 // 128)
    big = rows(4096, 1)  # 32768 words over 32 threads
    assert big.rounds == 1 and big.registers == 32 + 2 * 1024
    assert big.registers > model.MAX_THREAD_REGISTERS


def test_a_table_shipped_read_only(tuned: Any, monkeypatch: Any, tmp_path: Any) -> None:
    """A package ships its tuned table as a JSON file and passes it as cache=: where it cannot
    be written it is read, and a config it lacks is evaluated, not saved, and said so."""
    _, path, _ = tuned
    shipped = tmp_path / "tuned_v5e.json"
    shipped.write_text(path.read_text())

    def read_only(*_: Any) -> None:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(importlib.import_module("pallas_core.autotune_cache"), "_replace",
                        read_only)
    result = pl.autotune(build_matmul, SPACE, A, A, backend="mosaic_tpu", target="v5e",
                         cache=shipped)
    assert result.evaluated == 0 and not any("could not be written" in n
                                             for n in result.notes)
    space = [*autotune_module.configs_of(SPACE), {"bm": 256, "bn": 256, "bk": 4096}]
    more = pl.autotune(build_matmul, space, A, A, backend="mosaic_tpu", target="v5e",
                       cache=shipped)
    assert more.evaluated == 1 and any("could not be written" in n for n in more.notes)
    assert shipped.read_text() == path.read_text()
    assert not list(tmp_path.glob(".tuned_v5e.json.*"))  # no temporary file left


# --- small kernels on the interpreter, on the CPU ----------------------------------------------


def _scale(x: Any, *, block: int, factor: float = 2.0) -> Any:
    spec = pl.BlockSpec((block, 128), lambda i: (i, 0))
    return pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * factor),
        jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // block,), in_specs=[spec],
        out_specs=spec, backend="interpret")(x)


def build_scale(block: int) -> Any:
    """Correct for every block but 32, where it scales by 3: the config the model prefers
    (fewest grid steps) gives a wrong result."""
    return functools.partial(_scale, block=block, factor=3.0 if block == 32 else 2.0)


X = jax.ShapeDtypeStruct((64, 128), jnp.float32)


def test_the_decorator_tunes_once_per_signature() -> None:
    @pl.autotune(space={"block": [8, 16]}, backend="interpret", target="v5e")
    def scaled(block: int) -> Any:
        return functools.partial(_scale, block=block)

    x = jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128)
    np.testing.assert_array_equal(scaled(x), 2 * x)
    np.testing.assert_array_equal(scaled(x + 1), 2 * (x + 1))
    assert len(scaled.results) == 1
    np.testing.assert_array_equal(jax.jit(scaled)(x[:32]), 2 * x[:32])
    assert len(scaled.results) == 2
    (small,) = [r for s, r in scaled.results.items() if "32,128" in s]
    assert small.best == {"block": 16} and small.source == "model"


def test_measuring_the_interpreters_runs_on_the_cpu(tmp_path: Any, monkeypatch: Any) -> None:
    space = {"block": [8, 16, 64]}
    result = pl.autotune(build_scale, space, X, backend="interpret", target="v5e",
                         cache=tmp_path / "c.json", measure=True, top_k=2, runs=3)
    assert result.source == "measured"
    measured = [r for r in result.table if r.verdict == "measured"]
    assert len(measured) == 2 and all(r.measured_seconds > 0 for r in measured)
    assert result.best == measured[0].config
    assert measured[0].measured_seconds == min(r.measured_seconds for r in measured)
    assert [r.verdict for r in result.table].count("ranked") == 1
    compiled = []
    monkeypatch.setattr(autotune_measure, "compile_all",
                        lambda *a: compiled.append(a) or [])
    again = pl.autotune(build_scale, space, X, backend="interpret", target="v5e",
                        cache=tmp_path / "c.json", measure=True, top_k=2, runs=3)
    assert not compiled and again.best == result.best and again.source == "measured"


def test_measure_true_needs_a_device_the_backend_runs_on() -> None:
    pytest.importorskip("pallas_mosaic_tpu")
    with pytest.raises(pl.ArgumentError, match=r"measure=True.*Fix"):
        pl.autotune(build_matmul, {"bm": [512], "bn": [512], "bk": [512]}, A, A,
                    backend="mosaic_tpu", target="v5e", measure=True)


@pytest.mark.parametrize("reference", ["first", lambda x: 2 * x])
def test_a_config_with_a_wrong_result_is_never_picked(reference: Any) -> None:
    space = {"block": [8, 16, 32]}
    unchecked = pl.autotune(build_scale, space, X, backend="interpret", target="v5e")
    assert unchecked.best == {"block": 32}  # the model prefers the fewest steps
    checked = pl.autotune(build_scale, space, X, backend="interpret", target="v5e",
                          reference=reference, top_k=2)
    assert checked.best == {"block": 16}
    (wrong,) = [r for r in checked.table if r.config == {"block": 32}]
    assert wrong.verdict == "pruned" and wrong.reason.startswith("wrong result")


def test_errors_of_the_build_and_the_space() -> None:
    def broken(block: int) -> Any:
        if block == 16:
            raise ValueError("block must divide 40")
        if block == 32:
            raise TypeError("a bug in build")
        return functools.partial(_scale, block=block)

    result = pl.autotune(broken, {"block": [8, 16]}, X, backend="interpret", target="v5e")
    (row,) = [r for r in result.table if r.verdict == "pruned"]
    assert "ValueError: block must divide 40" in row.reason
    with pytest.raises(TypeError, match="a bug in build"):
        pl.autotune(broken, {"block": [8, 32]}, X, backend="interpret", target="v5e")
    with pytest.raises(pl.ArgumentError, match=r"every configuration.*Fix"):
        pl.autotune(broken, [{"block": 16}], X, backend="interpret", target="v5e")
    with pytest.raises(pl.ArgumentError, match=r"list of choices for 'block'.*Fix"):
        pl.autotune(broken, {"block": 8}, X, backend="interpret")
    with pytest.raises(pl.ArgumentError, match="no configuration its constraints allow"):
        pl.autotune(broken, {"block": [8]}, X, constraints=lambda c: c["block"] > 8)
    kept = pl.autotune(build_scale, {"block": [8, 16, 32]}, X, backend="interpret",
                       target="v5e", constraints=lambda c: c["block"] < 32)
    assert [r.config["block"] for r in kept.table] == [16, 8]


def test_without_backend_the_kernels_own_is_used() -> None:
    result = pl.autotune(build_scale, {"block": [8, 16]}, X, target="v5e")
    assert result.backend == "interpret" and result.target == "v5e"
    assert result.table[0].predicted_seconds is not None


def test_progress_only_on_a_terminal(capsys: Any) -> None:
    pl.autotune(build_scale, {"block": [8, 16]}, X, backend="interpret", target="v5e")
    assert capsys.readouterr().err == ""
    pl.autotune(build_scale, {"block": [8, 16]}, X, backend="interpret", target="v5e",
                progress=True)
    err = capsys.readouterr().err
    assert "2/2 evaluated, 0 pruned, 2 ranked" in err and "best so far" in err
