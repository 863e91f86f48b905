#!/usr/bin/env bash
# Runs every test of the workspace against the real QEMU and NBD tools,
# installing them first when they are missing (Debian packages; needs root
# or sudo), plus the formatting and lint gates.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for tool in qemu-img:qemu-utils qemu-io:qemu-utils qemu-nbd:qemu-utils \
            nbdkit:nbdkit nbdinfo:libnbd-bin nbdcopy:libnbd-bin fio:fio \
            mkfs.ext4:e2fsprogs e2fsck:e2fsprogs filefrag:e2fsprogs losetup:mount; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool##*:}")
done
# OpenSSL (TLS-PSK) is linked from the system.
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
pkg-config --exists openssl 2>/dev/null || missing+=(libssl-dev)
if [ ${#missing[@]} -gt 0 ]; then
  pkgs=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
  echo "installing: $pkgs"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get install -y $pkgs || { $sudo_cmd apt-get update && $sudo_cmd apt-get install -y $pkgs; }
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release -- -D warnings
cargo test --workspace --release
echo "all tests passed"
