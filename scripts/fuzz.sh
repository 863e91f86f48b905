#!/usr/bin/env bash
# Runs the cargo-fuzz targets of fuzz/ for a fixed time each.
#
#   scripts/fuzz.sh list                 the targets, one a line
#   scripts/fuzz.sh TARGET MINUTES       one target
#   scripts/fuzz.sh all MINUTES          every target in turn
#   ... [-- LIBFUZZER-ARGS]              passed on to libFuzzer (e.g. -jobs=2)
#
# Each run starts from the committed seeds (fuzz/corpus/TARGET, never
# written to) and the inputs earlier runs found (fuzz/found/TARGET, where
# new ones go), so longer runs add up. A crash, panic, timeout (a hang) or
# out-of-memory leaves its input in fuzz/artifacts/TARGET/ and makes the
# exit status 1; the run's output is in fuzz/found/TARGET.log. cargo-fuzz is
# installed when missing; the targets build on the stable toolchain with
# RUSTC_BOOTSTRAP=1. Nothing here is a test: the suite runs the bounded
# versions (crates/*/tests/fuzz_bounded.rs).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

targets() {
  awk '/^\[\[bin\]\]/ { bin = 1; next } bin && /^name *=/ { gsub(/.*= *"|".*/, ""); print; bin = 0 }' \
    fuzz/Cargo.toml
}

# libFuzzer options per target: the config target needs inputs longer than
# the 4 KiB default to reach the export name length check.
target_args() {
  case $1 in
    config) echo "-max_len=16384" ;;
  esac
}

# One target for $2 minutes; prints a summary line; status 1 on a finding.
run_one() {
  local target=$1 minutes=$2
  shift 2
  local found=fuzz/found/$target artifacts=fuzz/artifacts/$target
  local log=fuzz/found/$target.log
  mkdir -p "$found" "$artifacts" "fuzz/corpus/$target"
  local before
  before=$(ls "$artifacts")
  echo "== $target: $minutes min (log: $log)" >&2
  local status=0
  # shellcheck disable=SC2046
  RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" "$found" "fuzz/corpus/$target" -- \
    -max_total_time=$((minutes * 60)) -timeout=30 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
    -print_final_stats=1 $(target_args "$target") "$@" 2>&1 | tee "$log" >&2 || status=$?
  local new
  new=$(comm -13 <(printf '%s\n' "$before") <(ls "$artifacts"))
  local done_line execs rate
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  if [ "$status" -ne 0 ] || [ -n "$new" ]; then
    echo "$target: FAILED after ${execs:-?} runs (status $status)"
    for f in $new; do
      echo "  input: $artifacts/$f"
      echo "  replay: RUSTC_BOOTSTRAP=1 cargo fuzz run $target $artifacts/$f"
    done
    return 1
  fi
  echo "$target: ok, ${execs:-?} runs, ${rate:-?} exec/s, ${done_line#*DONE   }"
}

[ $# -ge 1 ] || usage
if [ "$1" = list ]; then
  targets
  exit 0
fi
[ $# -ge 2 ] || usage
what=$1 minutes=$2
shift 2
if [ $# -gt 0 ]; then
  [ "$1" = -- ] || usage
  shift
fi
case $minutes in
  '' | *[!0-9]* | 0) echo "MINUTES must be a whole number above 0, not '$minutes'" >&2; exit 2 ;;
esac
if [ "$what" = all ]; then
  list=$(targets)
elif targets | grep -qx -- "$what"; then
  list=$what
else
  echo "unknown fuzz target '$what'; the targets are:" >&2
  targets >&2
  exit 2
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz" >&2
  cargo install --locked cargo-fuzz
fi
# Build every target first, so a build error stops before any fuzzing.
RUSTC_BOOTSTRAP=1 cargo fuzz build

summary=() failed=0
for target in $list; do
  if line=$(run_one "$target" "$minutes" "$@"); then :; else failed=1; fi
  summary+=("$line")
done
printf '%s\n' "${summary[@]}"
exit "$failed"
