#!/usr/bin/env bash
# ci/rxe.sh: runs one command inside a throw-away QEMU VM whose kernel has a
# soft-RoCE device (rdma_rxe on loopback), so the verbs transport is tested
# on machines whose own kernel has no RDMA. The host's / is shared
# read-only and the repository read-write at the same path: binaries built
# on the host run unchanged inside, as root, with `ulimit -l unlimited`.
#
# Usage: ci/rxe.sh [-t SECONDS] [--] COMMAND [ARGS...]
# Exit status: COMMAND's; 124 on timeout; 125 if the VM failed first.
# The VM runs under emulation (TCG, no KVM needed): good for correctness,
# meaningless for speed. Debian's kernel and a busybox initramfs are
# prepared once into RXE_CACHE (default /tmp/coll-rxe, about 70 MB).
set -euo pipefail

timeout=1800
while [ $# -gt 0 ]; do
  case "$1" in
    -t) timeout=$2; shift 2 ;;
    --) shift; break ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "rxe.sh: no command (try --help)" >&2; exit 125; }
[ "$(id -u)" = 0 ] || { echo "rxe.sh: must run as root (apt-get, 9p shares)" >&2; exit 125; }
die() { echo "rxe.sh: $*" >&2; exit 125; }

repo=$(cd "$(dirname "$0")/.." && pwd -P)
cache=${RXE_CACHE:-/tmp/coll-rxe}

# The guest runs the host's own user space: rdma-core's rxe provider, the
# `rdma` tool (iproute2), busybox for the initramfs.
packages="qemu-system-x86 busybox-static rdma-core ibverbs-providers iproute2 kmod cpio xz-utils"
for p in $packages; do
  dpkg -s "$p" >/dev/null 2>&1 && continue
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends $packages >/dev/null 2>&1 || {
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends $packages >/dev/null
  } || die "apt-get install $packages failed"
  break
done

# Modules the guest loads, dependencies included by modprobe --show-depends.
# crc32_generic: rxe computes the RoCE ICRC with the "crc32" hash;
# sch_netem and veth: packet loss on a routed path for ci/loss.sh.
modules="virtio_pci 9pnet_virtio 9p crc32_generic rdma_rxe ib_uverbs sch_netem veth"

# Module signatures are checked with RSA under emulation, seconds each; a
# throw-away kernel can run them unsigned.
strip_signature() {
  local f=$1 size siglen
  [ "$(tail -c 28 "$f")" = "~Module signature appended~" ] || return 0
  size=$(stat -c %s "$f")
  siglen=$(tail -c 32 "$f" | head -c 4 | od -An -tu1 | awk '{print $1*16777216+$2*65536+$3*256+$4}')
  truncate -s $((size - siglen - 40)) "$f"
}

write_init() {
  cat >"$1" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s
export PATH=/bin:/sbin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /modules.list); do insmod /lib/modules/$m; done
o=trans=virtio,version=9p2000.L,msize=512000
mount -t 9p -o $o,cache=none ctl /ctl
mount -t 9p -o $o,ro,cache=loose root /newroot
n=/newroot
mount -t proc proc $n/proc; mount -t sysfs sys $n/sys; mount -t devtmpfs dev $n/dev
mkdir -p $n/dev/shm $n/dev/pts; mount -t tmpfs shm $n/dev/shm; mount -t devpts pts $n/dev/pts
for d in /tmp /run /var/tmp /root; do mount -t tmpfs -o mode=1777 tmp $n$d; done
repo=$(cat /ctl/repo)
# (a repository under /tmp needs its mount point in the fresh tmpfs)
mkdir -p $n$repo 2>/dev/null
mount -t 9p -o $o,cache=mmap,access=any repo $n$repo || echo "rxe.sh: cannot mount $repo" >/dev/ttyS1
mkdir -p $n/run/ctl; mount -o bind /ctl $n/run/ctl
ip link set lo up
hostname rxe-vm
stty -F /dev/ttyS1 raw -echo
if chroot $n rdma link add rxe0 type rxe netdev lo; then
  chroot $n /bin/bash /run/ctl/run.sh </dev/null >/dev/ttyS1 2>&1
  echo $? >/ctl/rc
else
  echo 125 >/ctl/rc
fi
sync
poweroff -f
INIT
  chmod +x "$1"
}

# Debian's kernel (rdma_rxe is a module there) and an initramfs, once.
prepare() {
  local pkg tmp k version root f
  pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  if [ -z "$pkg" ]; then
    apt-get update -q >/dev/null
    pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  fi
  [ -n "$pkg" ] || die "cannot find Debian's kernel package"
  [ "$(cat "$cache/stamp" 2>/dev/null)" = "$pkg 6" ] && return 0
  echo "rxe.sh: preparing $pkg and an initramfs in $cache" >&2
  mkdir -p "$cache"
  tmp=$(mktemp -d "$cache/build.XXXXXX")
  # (as root apt-get download warns that it runs unsandboxed: only shown on failure)
  (cd "$tmp" && apt-get download -q "$pkg" >"$tmp/log" 2>&1) || { cat "$tmp/log" >&2; die "apt-get download $pkg failed"; }
  k=$tmp/kernel
  mkdir "$k"
  dpkg-deb --fsys-tarfile "$tmp"/*.deb | tar -x -C "$k" --wildcards './boot/vmlinuz-*' \
    './lib/modules/*/kernel/*' './lib/modules/*/modules.*'
  version=$(ls "$k/lib/modules")
  depmod -b "$k" "$version"
  root=$tmp/root
  mkdir -p "$root"/{bin,sbin,proc,sys,dev,ctl,newroot,lib/modules}
  cp /bin/busybox "$root/bin/"
  for m in $modules; do
    modprobe -d "$k" -S "$version" --show-depends "$m" | awk '$1 == "insmod" {print $2}'
  done | awk '!seen[$0]++' | while read -r f; do
    cp "$f" "$root/lib/modules/"
    strip_signature "$root/lib/modules/$(basename "$f")"
    basename "$f" >>"$root/modules.list"
  done
  write_init "$root/init"
  (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) >"$cache/initramfs.gz"
  # The ELF kernel inside the bzImage boots directly (PVH entry), skipping
  # the real-mode setup and the xz decompressor, both slow under emulation.
  f=$(ls "$k"/boot/vmlinuz-*)
  local at
  at=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$f" | awk -F: 'NR == 1 {print $1}')
  # (xz reads one stream and stops: no pipe, whose writer pipefail would fail)
  if [ -n "$at" ] && tail -c +$((at + 1)) "$f" >"$tmp/payload.xz" &&
    xz -dc --single-stream "$tmp/payload.xz" >"$tmp/vmlinux" 2>/dev/null &&
    [ "$(head -c 4 "$tmp/vmlinux" | tail -c 3)" = ELF ]; then
    mv "$tmp/vmlinux" "$cache/kernel"
  else
    cp "$f" "$cache/kernel"
  fi
  echo "$pkg 6" >"$cache/stamp"
  rm -rf "$tmp"
}
mkdir -p "$(dirname "$cache")"
exec 9>"$cache.lock"
flock 9
prepare
exec 9>&-

ctl=$(mktemp -d /tmp/coll-rxe-run.XXXXXX)
trap 'rm -rf "$ctl"' EXIT
echo "$repo" >"$ctl/repo"
{
  echo 'set +e'
  export -p | grep -v -E '^declare -x (PWD|OLDPWD|SHLVL|_|TMPDIR|TERM|SSH_[A-Z_]*)='
  echo 'ulimit -l unlimited'
  printf 'cd %q || exit 125\n' "$PWD"
  printf '%q ' "$@"
  echo
} >"$ctl/run.sh"

# ttyS0 is the kernel's console (kept for failures); ttyS1 carries the
# command's output to our stdout.
set +e
timeout -k 5 "$timeout" qemu-system-x86_64 -machine q35 -accel tcg,thread=multi,tb-size=256 \
  -cpu max -smp "$(nproc)" -m 4096 -nodefaults -display none -no-reboot \
  -kernel "$cache/kernel" -initrd "$cache/initramfs.gz" \
  -append "console=ttyS0 panic=-1 quiet loglevel=3 rdinit=/init" \
  -serial "file:$ctl/console.log" -serial stdio \
  -fsdev local,id=root,path=/,security_model=none,readonly=on,multidevs=remap \
  -device virtio-9p-pci,fsdev=root,mount_tag=root \
  -fsdev local,id=repo,path="$repo",security_model=none,multidevs=remap \
  -device virtio-9p-pci,fsdev=repo,mount_tag=repo \
  -fsdev local,id=ctl,path="$ctl",security_model=none \
  -device virtio-9p-pci,fsdev=ctl,mount_tag=ctl </dev/null
qemu=$?
set -e
[ $qemu = 124 ] || [ $qemu = 137 ] && { echo "rxe.sh: timed out after ${timeout}s" >&2; exit 124; }
[ -s "$ctl/rc" ] && exit "$(cat "$ctl/rc")"
echo "rxe.sh: the VM stopped without a result (qemu status $qemu); its console:" >&2
tail -n 30 "$ctl/console.log" >&2
exit 125
