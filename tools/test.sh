#!/usr/bin/env bash
# The test command: fetch the real default model if needed, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# The product needs nothing outside the repository: no path may reach beside it.
if grep -rIn --exclude-dir=target --exclude-dir=.git --exclude-dir=out --exclude-dir=models '\.\./shared' .; then
  echo "test.sh: the lines above reach outside the repository" >&2
  exit 1
fi
cargo test --workspace --release "$@"
# The OpenAI Python SDK against a running `forge serve` (the release binary built above).
python3 -c 'import openai' 2>/dev/null || python3 -m pip install --quiet openai
cargo build --release --bin forge
python3 tools/test_openai_sdk.py --forge target/release/forge
# Every command of the README, as written, from the repository root.
python3 tools/readme_commands.py
# The aarch64 NEON kernels, cross-built and run under QEMU (installs Debian's cross toolchain).
bash tools/test_neon.sh
