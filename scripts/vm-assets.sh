#!/usr/bin/env bash
# Prepares what the VM tests boot: Debian's cloud kernel (taken from its
# package without installing it), its virtio modules, and a busybox
# initramfs whose /init loads them, runs /test.sh if one was appended (a
# second cpio archive) and powers off. mke2fs and its libraries come from
# the host so the guest can make a real ext4.
#
# Usage: scripts/vm-assets.sh OUT_DIR     (prints nothing new when OUT_DIR is ready)
# Needs: apt-get (root), busybox-static, cpio, e2fsprogs, qemu-system-x86 (bookworm-backports).
set -euo pipefail
out=${1:?usage: vm-assets.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
[ -f "$out/vmlinuz" ] && [ -f "$out/initramfs.cpio.gz" ] && exit 0

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-/ {print $2; exit}')
if [ -z "$pkg" ]; then
  apt-get update -q >/dev/null
  pkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')
fi
[ -n "$pkg" ] || { echo "vm-assets: no linux-image-cloud-amd64 package found" >&2; exit 1; }
(cd "$work" && apt-get download "$pkg" >/dev/null 2>&1) || { echo "vm-assets: cannot download $pkg" >&2; exit 1; }
dpkg-deb -x "$work"/"$pkg"_*.deb "$work/k"
kver=$(ls "$work/k/lib/modules")
cp "$work/k/boot/vmlinuz-$kver" "$out/vmlinuz.tmp"

root="$work/root"
mkdir -p "$root"/{bin,sbin,proc,sys,dev,mnt,tmp,lib/modules,etc}
cp /bin/busybox "$root/bin/busybox"
for m in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk; do
  f=$(find "$work/k/lib/modules/$kver" -name "$m.ko*" | head -1)
  [ -n "$f" ] || { echo "vm-assets: module $m missing from $pkg" >&2; exit 1; }
  case "$f" in
    *.xz) xz -dc "$f" > "$root/lib/modules/$m.ko" ;;
    *.zst) zstd -qdc "$f" > "$root/lib/modules/$m.ko" ;;
    *) cp "$f" "$root/lib/modules/$m.ko" ;;
  esac
done
# The host's mke2fs (busybox has only an ext2 one) as /opt/mkfs.ext4, with
# the shared libraries it needs at the same paths.
mke2fs=$(command -v mke2fs)
mkdir -p "$root/opt"
cp "$mke2fs" "$root/opt/mkfs.ext4"
[ -f /etc/mke2fs.conf ] && cp /etc/mke2fs.conf "$root/etc/"
for lib in $(ldd "$mke2fs" | grep -o '/[^ ]*'); do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
cat > "$root/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk; do
  insmod /lib/modules/$m.ko 2>/dev/null
done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
echo "VDCACHE-GUEST booted $(cut -d' ' -f1 /proc/uptime)"
if [ -x /test.sh ]; then
  /test.sh
  echo "VDCACHE-GUEST exit $?"
fi
sync
poweroff -f
INIT
chmod +x "$root/init"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$out/initramfs.cpio.gz.tmp"
mv "$out/vmlinuz.tmp" "$out/vmlinuz"
mv "$out/initramfs.cpio.gz.tmp" "$out/initramfs.cpio.gz"
echo "vm-assets: $pkg and a busybox initramfs in $out"
