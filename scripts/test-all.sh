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
# OpenSSL (TLS-PSK) and zstd (qcow2's zstd compression) are linked from
# the system.
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
pkg-config --exists openssl 2>/dev/null || missing+=(libssl-dev)
pkg-config --exists libzstd 2>/dev/null || missing+=(libzstd-dev)
# The VM tests: busybox and cpio build the guest's initramfs, debugfs reads
# its files back (e2fsprogs, above).
# Operator integration: libvirt's domain validator (and its xmllint), the
# systemd unit verifier, setpriv to run clients as another user.
for tool in busybox:busybox-static cpio:cpio virt-xml-validate:libvirt-clients \
            xmllint:libxml2-utils systemd-analyze:systemd setpriv:util-linux; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool##*:}")
done
sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
if [ ${#missing[@]} -gt 0 ]; then
  pkgs=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
  echo "installing: $pkgs"
  $sudo_cmd apt-get install -y $pkgs || { $sudo_cmd apt-get update && $sudo_cmd apt-get install -y $pkgs; }
fi
# qemu-system-x86 must match qemu-utils (10.0, from bookworm-backports on
# Debian 12): bookworm's own 7.2 would replace qemu-utils.
if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then
  if grep -q 'VERSION_CODENAME=bookworm' /etc/os-release 2>/dev/null; then
    if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
      echo "adding Debian's bookworm-backports suite (for qemu-system-x86 10.0)"
      printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        | $sudo_cmd tee /etc/apt/sources.list.d/vdcache-backports.sources >/dev/null
    fi
    $sudo_cmd apt-get update -q
    $sudo_cmd apt-get install -y -t bookworm-backports qemu-system-x86
  else
    $sudo_cmd apt-get install -y qemu-system-x86 || { $sudo_cmd apt-get update && $sudo_cmd apt-get install -y qemu-system-x86; }
  fi
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release -- -D warnings
# No crate has doc-tests: without --doc, rustdoc is not run over every
# crate to find none.
cargo test --workspace --release --lib --bins --tests --examples
echo "all tests passed"
