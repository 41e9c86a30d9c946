#!/usr/bin/env bash
# Every GPU claim of this project, run in one go on a CUDA machine: scripts/gpu_check.sh OUTDIR
#
# On a machine with a GPU (an H100 is the one in mind: JAX with its CUDA plugin, triton,
# pytest and pluggy installed, no network), from a checkout, it
#   1. install   installs the checkout into the machine's Python offline (pip, --no-index
#                --no-deps --no-build-isolation, editable); where pip cannot, it puts the
#                checkout on PYTHONPATH with generated package metadata (the backends' entry
#                points) in OUTDIR/site instead;
#   2. versions  prints the driver (nvidia-smi), Python, JAX, jaxlib, triton and the backends
#                pallas_core loads;
#   3. device    prints the GPU as JAX sees it;
#   4. suite     runs the GPU suite, `pytest -m gpu tests/gpu` (a per-test timeout), JUnit XML
#                into OUTDIR/junit.xml;
#   5. bench_triton, 6. bench_mosaic
#                runs benchmarks/gpu_triton.py and gpu_mosaic.py --quick (this project,
#                jax.experimental.pallas and jax.numpy side by side, with ratios), JSON into
#                OUTDIR/bench_triton.json and OUTDIR/bench_mosaic.json;
# logs everything to OUTDIR/gpu_check.log (and the terminal), writes one line per step to
# OUTDIR/summary.txt, and exits 1 if any step failed. Every step runs under a time limit, cut
# to what is left of 450 s from the start (PALLAS_GPU_CHECK_BUDGET; a step past its limit gets
# 15 s to stop), so the whole fits in 8 minutes.
#
# Without a GPU (JAX sees none and nvidia-smi lists none) it checks that it would run: the
# install as a pip --dry-run, the versions, `pytest --collect-only -m gpu` (which must collect
# every GPU test module), and each benchmark's --dry-run (its kernels built for cuda, not
# run). Their output goes to OUTDIR/gpu_check.log; it prints one line, that no GPU was found,
# and exits 0 (1 if the dry run failed). `--dry-run` asks for this mode on any machine.
#
# PALLAS_GPU_CHECK_FAKE_GPU=1 makes it believe a GPU exists: on CPU it then goes through
# every step for real (the install as a pip --dry-run, so that the environment is left as it
# is), each failing at its first call that needs the GPU, and exits 1. That shows the steps
# are wired (tests/test_gpu_check_script.py checks it). PYTHON names the interpreter (default
# python3); PALLAS_GPU_CHECK_INSTALL=pythonpath skips pip and uses the PYTHONPATH fallback.
set -u -o pipefail
# The whole run's deadline: each step's limit is cut to the time left.
BUDGET=${PALLAS_GPU_CHECK_BUDGET:-450}
DEADLINE=$(( $(date +%s) + BUDGET ))

usage() { echo "usage: $0 [--dry-run] OUTDIR" >&2; exit 2; }
DRY=0
OUT=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
        -*) usage ;;
        *) [ -z "$OUT" ] || usage; OUT=$arg ;;
    esac
done
[ -n "$OUT" ] || usage
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
LOG=$OUT/gpu_check.log
SUMMARY=$OUT/summary.txt
: > "$LOG"
: > "$SUMMARY"
cd "$ROOT" || exit 2
# The suite's per-test limit (tests/gpu/conftest.py), where pytest-timeout is absent.
export PALLAS_TEST_TIMEOUT=${PALLAS_TEST_TIMEOUT:-90}
PACKAGES=(. plugins/pallas_interpret plugins/pallas_triton plugins/pallas_mosaic_gpu
          plugins/pallas_mosaic_tpu plugins/pallas_sparsecore)

# --- the mode ---------------------------------------------------------------------------------
jax_sees_gpu() {
    "$PYTHON" -c "import jax, sys; sys.exit(0 if jax.devices('gpu') else 1)" >/dev/null 2>&1
}
nvidia_lists_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'
}
WHY="no GPU found (JAX sees none, nvidia-smi lists none)"
if [ "$DRY" = 1 ]; then
    MODE=dry
    WHY="--dry-run: no GPU used"
elif [ "${PALLAS_GPU_CHECK_FAKE_GPU:-0}" = 1 ]; then
    MODE=fake
elif jax_sees_gpu; then
    MODE=gpu
elif nvidia_lists_gpu; then
    echo "gpu_check: nvidia-smi lists a GPU but JAX sees none (is JAX's CUDA plugin installed," \
         "JAX_PLATFORMS unset?): $("$PYTHON" -c 'import jax; jax.devices("gpu")' 2>&1 | tail -1)"
    exit 1
else
    MODE=dry
fi

# --- running steps ----------------------------------------------------------------------------
FAILED=()
export MODE PYTHON ROOT OUT
# Output into the log, and to the terminal too unless dry (the exit status is the command's).
logged() {
    if [ "$MODE" = dry ]; then "$@" >> "$LOG" 2>&1; else "$@" 2>&1 | tee -a "$LOG"; fi
}
say() { echo "$*" >> "$LOG"; [ "$MODE" = dry ] || echo "$*"; }
# record NAME RC START LIMIT: the step's line in the summary.
record() {
    local outcome=ok
    [ "$2" = 0 ] || outcome="FAILED (exit $2$([ "$2" = 124 ] \
        && echo ": out of time, its ${4}s or the run's budget"))"
    echo "step $1: $outcome in $(( $(date +%s) - $3 ))s" >> "$SUMMARY"
    say "=== step $1: $outcome in $(( $(date +%s) - $3 ))s"
    [ "$2" = 0 ] || FAILED+=("$1")
}
# limited SECONDS COMMAND...: COMMAND under the smaller of SECONDS and the time left, stopped
# by SIGINT (pytest still writes its JUnit XML; Python prints where it was), then SIGKILL.
limited() {
    local limit=$1 left=$(( DEADLINE - $(date +%s) ))
    shift
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        echo "no time left (PALLAS_GPU_CHECK_BUDGET=${BUDGET}s): not run"
        return 124
    fi
    timeout -s INT -k 15 "$limit" "$@"
}
# step NAME SECONDS COMMAND...: COMMAND (a program) under a time limit.
step() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    say "=== step $name (limit ${limit}s): $*"
    logged limited "$limit" "$@"
    rc=$?
    record "$name" $rc "$start" "$limit"
}

# The fallback install: the packages' source directories on PYTHONPATH and, first on it, a
# directory of generated *.dist-info (name, version, entry points), so that importlib.metadata
# finds the backends as it finds installed ones.
write_metadata() {
    "$PYTHON" - "$OUT/site" "${PACKAGES[@]}" <<'EOF'
import pathlib, re, sys, tomllib
site = pathlib.Path(sys.argv[1])
site.mkdir(parents=True, exist_ok=True)
for package in sys.argv[2:]:
    pyproject = tomllib.loads((pathlib.Path(package) / "pyproject.toml").read_text())
    project = pyproject["project"]
    attr = pyproject["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    module, _, name = attr.rpartition(".")
    source = pathlib.Path(package, *module.split("."))
    source = source / "__init__.py" if source.is_dir() else source.with_suffix(".py")
    version = re.search(rf'^{name}\s*=\s*"([^"]+)"', source.read_text(), re.M).group(1)
    dist = site / f"{project['name'].replace('-', '_')}-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {version}\n")
    (dist / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
        for group, eps in project.get("entry-points", {}).items()))
    print(f"{project['name']} {version}: {package} on PYTHONPATH, metadata in {dist}")
EOF
}

# Runs in this shell, not under `step`: the fallback's PYTHONPATH must reach the later steps.
step_install() {
    local start rc flags=(--no-deps --no-build-isolation --no-index) editable=()
    start=$(date +%s)
    [ "$MODE" = gpu ] || flags+=(--dry-run)  # elsewhere the environment is left as it is
    for p in "${PACKAGES[@]}"; do editable+=(-e "$p"); done
    say "=== step install (limit 120s)"
    if [ "${PALLAS_GPU_CHECK_INSTALL:-pip}" = pythonpath ]; then
        say "PALLAS_GPU_CHECK_INSTALL=pythonpath: pip not tried"
        rc=1
    else
        logged limited 120 "$PYTHON" -m pip install "${flags[@]}" "${editable[@]}"
        rc=$?
        [ $rc = 0 ] || say "pip install failed (exit $rc): falling back to PYTHONPATH"
    fi
    if [ $rc != 0 ]; then
        logged write_metadata
        rc=$?
        if [ $rc = 0 ]; then
            local path="$OUT/site"
            for p in "${PACKAGES[@]}"; do path="$path:$ROOT/${p#./}"; done
            export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}"
            say "PYTHONPATH=$PYTHONPATH"
        fi
    fi
    record install $rc "$start" 120
}

versions() {
    echo "mode: $MODE; checkout: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null \
        || echo 'not a git checkout'))"
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); host: $(uname -n); cores: $(nproc)"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
        nvidia-smi | sed -n '1,4p'
    else
        echo "nvidia-smi: not found"
    fi
    "$PYTHON" - <<'EOF'
import importlib.metadata as md
import importlib.util
import platform


def _has(module):
    return importlib.util.find_spec(module) is not None


print(f"Python {platform.python_version()} ({platform.python_implementation()})")
for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "jax-cuda13-pjrt",
             "jax-cuda12-pjrt", "triton", "pytest", "pluggy", "absl-py", "numpy",
             "setuptools", "pytest-timeout"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name}: not installed")
from pallas_core.plugins import manager
print("pallas_core backends:", ", ".join(sorted(manager.backends())))
for name, reason in sorted(manager.skipped().items()):
    print(f"  not loaded: {name}: {reason}")
missing = {"triton", "mosaic_gpu"} - set(manager.backends())
if missing:
    hint = ("" if "mosaic_gpu" not in missing or _has("absl") else " (absl-py is not installed:"
            " JAX's Mosaic GPU library, which the mosaic_gpu backend imports, needs it)")
    raise SystemExit(f"the GPU backends {sorted(missing)} did not load{hint}")
EOF
}

device() {
    "$PYTHON" - <<'EOF'
import jax
gpus = jax.devices("gpu")  # the first call that needs a GPU
for d in gpus:
    print(f"{d}: {d.device_kind}, compute capability "
          f"{getattr(d, 'compute_capability', '?')}, {getattr(d, 'core_count', '?')} SMs")
print("default backend:", jax.default_backend())
EOF
}

collect() {
    local listing
    listing=$("$PYTHON" -m pytest --collect-only -q -m gpu tests/gpu 2>&1)
    local rc=$?
    echo "$listing"
    [ $rc = 0 ] || return $rc
    for m in test_on_gpu_seeds test_on_gpu_conformance test_on_gpu_triton_library \
             test_on_gpu_mosaic_library; do
        echo "$listing" | grep -q "^tests/gpu/$m.py::" \
            || { echo "no test of tests/gpu/$m.py was collected"; return 1; }
    done
}

# The figures to record (benchmarks/RESULTS.md): the suite's counts and the benchmarks' ratios.
figures() {
    "$PYTHON" - "$OUT" <<'EOF'
import json, pathlib, sys
import xml.etree.ElementTree as ET
out = pathlib.Path(sys.argv[1])
junit = out / "junit.xml"
if junit.exists():
    s = ET.parse(junit).getroot()
    s = s if s.tag == "testsuite" else s.find("testsuite")
    n, f, e, k = (int(s.get(a, 0)) for a in ("tests", "failures", "errors", "skipped"))
    print(f"suite: {n - f - e - k} passed, {f} failed, {e} errors, {k} skipped of {n}")
for name in ("bench_triton", "bench_mosaic"):
    path = out / f"{name}.json"
    if not path.exists():
        continue
    data = json.loads(path.read_text())
    rows = data.get("cases", data)
    for case, row in rows.items():
        if isinstance(row, dict) and ("ways" in row or "pallas_core_triton" in row):
            ratios = ", ".join(f"{k[len('ours_over_'):]} {v:.2f}x" for k, v in row.items()
                               if k.startswith("ours_over_") and v is not None)
            copy = row.get("fraction_of_copy_bandwidth")
            extra = f", {copy:.0%} of copy bandwidth" if copy is not None else ""
            print(f"{name}: {case}: speed of ours vs {ratios or 'n/a'}{extra}")
EOF
}

export -f versions device collect

# --- the steps --------------------------------------------------------------------------------
echo "gpu_check: mode $MODE, output in $OUT" >> "$LOG"
[ "$MODE" = dry ] || echo "gpu_check: mode $MODE, output in $OUT (log $LOG)"
step_install
step versions 60 bash -c versions
if [ "$MODE" = dry ]; then
    step collect 120 bash -c collect
    step bench_triton 60 "$PYTHON" benchmarks/gpu_triton.py --quick --dry-run
    step bench_mosaic 60 "$PYTHON" benchmarks/gpu_mosaic.py --quick --dry-run
    if [ ${#FAILED[@]} = 0 ]; then
        echo "gpu_check: $WHY; dry run passed:" \
             "$(tr '\n' ';' < "$SUMMARY" | sed 's/;$//') (log: $LOG)"
        exit 0
    fi
    echo "gpu_check: $WHY, and the dry run FAILED: ${FAILED[*]} (see $LOG)"
    exit 1
fi
step device 60 bash -c device
# -v: each test's outcome is in the log as it ends, should the step run out of time.
SUITE=(-m gpu tests/gpu -v -rfE --tb=short --durations=10 --junitxml="$OUT/junit.xml")
[ "$MODE" = fake ] && SUITE+=(--maxfail=1)  # every test fails alike, at its first GPU call
step suite 240 "$PYTHON" -m pytest "${SUITE[@]}"
step bench_triton 75 "$PYTHON" benchmarks/gpu_triton.py --quick --json "$OUT/bench_triton.json"
step bench_mosaic 90 "$PYTHON" benchmarks/gpu_mosaic.py --quick --warmup 1 --repeats 5 --inner 5 \
    --json "$OUT/bench_mosaic.json" --markdown "$OUT/bench_mosaic.md"
figures >> "$SUMMARY" 2>> "$LOG"
echo
cat "$SUMMARY"
if [ ${#FAILED[@]} != 0 ]; then
    echo "gpu_check: FAILED steps: ${FAILED[*]} (mode $MODE; log $LOG)" | tee -a "$LOG"
    exit 1
fi
echo "gpu_check: every step passed (log $LOG)" | tee -a "$LOG"
