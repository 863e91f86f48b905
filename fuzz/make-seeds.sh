#!/usr/bin/env bash
# Regenerates the generated part of the committed seed corpora (the files
# named gen-*) with the project's own writers: `vdcache trace-gen` for the
# traces, `vdcache create` and `vdcache io` for the qcow2 images, and the
# vhost-user target's bounded test for its seeds. The other
# seeds are written by hand and kept as they are. The output is the same on
# every run, so a diff after running this means a writer changed.
#
#   fuzz/make-seeds.sh [PATH-TO-vdcache]   (default: builds it with cargo)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -ge 1 ]; then
  vd=$1
else
  cargo build --release -p vdcache >&2
  vd="${CARGO_TARGET_DIR:-target}/release/vdcache"
fi
c=fuzz/corpus
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

quiet() { "$@" >"$tmp/log" 2>&1 || { cat "$tmp/log" >&2; exit 1; }; }
gen() { quiet "$vd" trace-gen --requests "$1" --disks 2 --format "$2" --class "$3" "$4"; }
for format in msr fiu blkparse fio; do
  mkdir -p "$c/trace_$format"
  for class in oltp boot-storm file-server; do
    gen 12 "$format" "$class" "$c/trace_$format/gen-$class.txt"
  done
done
# Detection sees every format, plain and compressed.
mkdir -p "$c/trace_detect"
for format in msr fiu blkparse fio; do
  gen 6 "$format" oltp "$c/trace_detect/gen-$format.txt"
done
gen 20 msr file-server "$c/trace_detect/gen-msr.csv.gz"
gen 8 fiu oltp "$c/trace_detect/gen-fiu.zst"

# Small images: 1 MiB virtual, 512-byte clusters unless the layout needs
# more, a few writes so that L2 tables and refcount blocks exist.
mkdir -p "$c/parse_image" "$c/parse_structures"
image() {
  local name=$1 opts=$2
  shift 2
  quiet "$vd" create -o "$opts" "$tmp/$name" 1M
  for cmd in "$@"; do quiet "$vd" io -c "$cmd" "$tmp/$name"; done
  cp "$tmp/$name" "$c/parse_image/gen-$name"
  # The structure parsers read the header and the tables behind it.
  head -c 2048 "$tmp/$name" >"$c/parse_structures/gen-$name"
}
image empty.qcow2 cluster_size=512
image written.qcow2 cluster_size=512 "write -P 0xa5 0 4k" "write -P 0x5a 700k 1536" "write -z 64k 8k" "discard 0 512"
image v2.qcow2 cluster_size=512,compat=0.10 "write -P 7 300k 1k"
image refcount1.qcow2 cluster_size=512,refcount_bits=1 "write -P 8 100k 1k"
image lazy-zstd.qcow2 cluster_size=1024,lazy_refcounts=on,compression_type=zstd,refcount_bits=64 "write -P 1 4k 2k"
image extended-l2.qcow2 cluster_size=16k,extended_l2=on "write -P 3 2k 1k" "write -z 20k 4k"

# The vhost-user seeds (all of fuzz/corpus/vhost_user): rings and messages
# laid out by the target's bounded test, which writes them when asked to.
quiet env VDCACHE_WRITE_SEEDS=1 cargo test --release -p vdcache-vhost-user-blk \
  --test fuzz_bounded the_committed_seeds_are_the_built_ones_and_pass
du -sh "$c" >&2
