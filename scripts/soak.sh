#!/usr/bin/env bash
# The long soak of issue 18: `vdcache serve` with a flash cache is killed
# with SIGKILL at random moments under a writing, flushing load and
# restarted on the same cache and images, in write-back and then in
# write-through mode; after every restart each write acknowledged before
# the last completed flush (or with FUA) must read back. Exit 0: no
# violation; 2: lost or corrupted data (files kept, reproducer printed);
# 1: the soak could not run.
#
#   scripts/soak.sh                          # 100 kill -9 cycles per mode
#   scripts/soak.sh --cycles 1000 --seed 7   # any `vdcache soak` option
#   scripts/soak.sh --serve-arg=--cow --serve-arg=stacked --extended-l2 off
#
# Runs niced; builds the release binary first (honours CARGO_TARGET_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p vdcache
target="${CARGO_TARGET_DIR:-target}"
exec nice -n 10 "$target/release/vdcache" soak "$@"
