#!/usr/bin/env bash
# The test command: fetch the real default model if needed, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
cargo test --workspace --release "$@"
# The OpenAI Python SDK against a running `forge serve` (the release binary built above).
python3 -c 'import openai' 2>/dev/null || python3 -m pip install --quiet openai
cargo build --release --bin forge
python3 tools/test_openai_sdk.py --forge target/release/forge
# The aarch64 NEON kernels, cross-built and run under QEMU (installs Debian's cross toolchain).
bash tools/test_neon.sh
