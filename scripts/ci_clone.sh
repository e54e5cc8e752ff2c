#!/usr/bin/env bash
# Run CI as CI runs it: a clean clone of a commit (default HEAD) in a scratch folder, `.ci/run` with no pip cache,
# then the clone is removed, venv and all (each clone holds a ~3.5 GB venv; clones left behind filled the disk
# until `make setup`'s free-space check refused the next CI run, stop 58).
#   scripts/ci_clone.sh [REV] [LOG]      (LOG default: ci-<rev>.log in the current folder)
# Keep the clone for inspection with KEEP_CLONE=1.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rev=$(git -C "$root" rev-parse --short=12 "${1:-HEAD}")
log=$(realpath -m "${2:-ci-$rev.log}")
clone=$(mktemp -d "${TMPDIR:-/tmp}/glm5lab-ci-$rev.XXXX")
[ "${KEEP_CLONE:-0}" = 1 ] || trap 'rm -rf "$clone"' EXIT
git clone -q "$root" "$clone"
git -C "$clone" checkout -q "$rev"
echo "[ci-clone] $rev in $clone, log $log"
rc=0
(cd "$clone" && PIP_NO_CACHE_DIR=1 .ci/run) >"$log" 2>&1 || rc=$?
tail -n 3 "$log"
echo "[ci-clone] $rev: rc $rc"
exit "$rc"
