#!/usr/bin/env bash
# The test command: fetch the real default model if needed, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
cargo test --workspace --release "$@"
