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
# A short soak of the server the README built (tools/soak.py; the full one runs 30 minutes).
python3 tools/soak.py --forge target/release/forge --model out/q4 --clients 16 --seconds 60 --log out/soak-server.log
# The aarch64 NEON kernels, cross-built and run under QEMU (installs Debian's cross toolchain).
bash tools/test_neon.sh
