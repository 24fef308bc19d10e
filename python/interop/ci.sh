#!/usr/bin/env bash
# The interop suite as CI runs it, from the repository root of a clean clone,
# after `cargo build -p kvbridge-cli` (README.md, "CI"). Creates (or reuses)
# a venv, installs sglang 0.5.23 without its dependencies and the pinned test
# dependencies, then runs pytest. Extra arguments go to pytest.
#   INTEROP_VENV   venv directory (default target/interop-venv)
#   PYTHON         interpreter that creates it (default python3.11)
#   KVBRIDGE_BIN   kvbridge binary (default target/debug/kvbridge)
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${INTEROP_VENV:-target/interop-venv}
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3.11}" -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps sglang==0.5.23
"$venv/bin/pip" install -q --disable-pip-version-check -r python/interop/requirements.txt
# kvbridge's Python package (the engine the sglang ranks switch to), built
# from this checkout with the pinned toolchain.
"$venv/bin/pip" install -q --disable-pip-version-check "maturin>=1.9,<2"
(. "$venv/bin/activate" && maturin develop -q -m crates/kvbridge-py/Cargo.toml)
export KVBRIDGE_BIN=${KVBRIDGE_BIN:-$PWD/target/debug/kvbridge}
# In CI the Rust-role tests must run, not skip.
if [ ! -x "$KVBRIDGE_BIN" ]; then
  echo "python/interop/ci.sh: no kvbridge binary at $KVBRIDGE_BIN (cargo build -p kvbridge-cli first)" >&2
  exit 1
fi
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider python/interop/tests "$@"
