#!/usr/bin/env bash
# Builds the sdist and wheel of all six distributions into dist/ (or $1), each wheel built from
# its sdist (so a file missing from an sdist fails here), then runs `twine check` on them all.
# Needs `build` and `twine` in the running Python: `tox -e dists` provides both.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-dist}")"
PYTHON="${PYTHON:-python}"
rm -rf "$out" && mkdir -p "$out"
for project in . plugins/pallas_interpret plugins/pallas_triton plugins/pallas_mosaic_tpu \
               plugins/pallas_mosaic_gpu plugins/pallas_sparsecore; do
    # Stale build/ and *.egg-info directories from editable installs must not leak in.
    rm -rf "$project/build" "$project"/*.egg-info
    "$PYTHON" -m build --outdir "$out" "$project" >"$out/.build.log" 2>&1 || {
        cat "$out/.build.log"; echo "building $project failed" >&2; exit 1; }
    rm -rf "$project/build" "$project"/*.egg-info
done
rm -f "$out/.build.log"
"$PYTHON" -m twine check --strict "$out"/*
ls "$out"
