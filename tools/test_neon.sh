#!/usr/bin/env bash
# The aarch64 NEON kernels: `forge-kernels`' tests cross-built for aarch64 and run under QEMU's
# user-mode emulation, against the same scalar references as on x86-64 (there the NEON code is
# not compiled at all). Debian's packages give what rustup's toolchain lacks offline here: a
# rustc whose aarch64 standard library is packaged (rustc-web with libstd-rust-web-dev:arm64),
# the aarch64 linker and C library, and qemu-aarch64-static. Installed when missing (as root,
# with apt); elsewhere the step is skipped with a note, except under CI, where it must run.
set -euo pipefail
cd "$(dirname "$0")/.."

have() {
  [ -d /usr/lib/rustlib/aarch64-unknown-linux-gnu ] && [ -x /usr/bin/cargo ] && [ -x /usr/bin/rustc ] \
    && command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64-static >/dev/null \
    && [ -e /lib/ld-linux-aarch64.so.1 ]
}

if ! have; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test_neon: installing the aarch64 cross toolchain and qemu-user-static" >&2
    dpkg --add-architecture arm64
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      rustc-web cargo-web libstd-rust-web-dev:arm64 libc6:arm64 gcc-aarch64-linux-gnu libc6-dev-arm64-cross \
      qemu-user-static >/dev/null
  elif [ "${CI:-}" = true ]; then
    echo "test_neon: the aarch64 toolchain is missing and cannot be installed (not root, or no apt)" >&2
    exit 1
  else
    echo "test_neon: skipped (needs Debian's rustc-web, libstd-rust-web-dev:arm64, gcc-aarch64-linux-gnu, qemu-user-static)" >&2
    exit 0
  fi
fi

# Debian's toolchain, not rustup's: its aarch64 standard library matches its own rustc. The
# emulated programs load the multiarch C library (libc6:arm64) with its own loader; QEMU's `-L`
# with the cross-linking copy mixes two glibc builds, and the first thread spawn then hangs.
export RUSTC=/usr/bin/rustc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER=qemu-aarch64-static
export CARGO_PROFILE_TEST_DEBUG=0 CARGO_PROFILE_DEV_DEBUG=0
# Twice: on QEMU's `max` CPU (with the dot-product extension: the `sdot` kernels on the pair
# layout) and on a Cortex-A72 (ARMv8.0: the base NEON kernels).
for cpu in max cortex-a72; do
  echo "test_neon: forge-kernels on an emulated aarch64 CPU ($cpu)"
  QEMU_CPU=$cpu /usr/bin/cargo test --locked -p forge-kernels --lib --target aarch64-unknown-linux-gnu \
    --target-dir target/aarch64 "$@"
done
