#!/usr/bin/env bash
# The real-scheduler suite (tests/test_sched.py) as CI runs it, from the
# repository root: a venv with torch (target/sched-venv), sglang 0.5.23
# without its dependencies, the pinned test dependencies, kvbridge's Python
# package built from this checkout, then pytest. Extra arguments go to pytest.
#   SCHED_VENV   venv directory (default target/sched-venv)
#   PYTHON       interpreter that creates it (default python3.11)
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${SCHED_VENV:-target/sched-venv}
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3.11}" -m venv "$venv"
fi
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" --no-deps sglang==0.5.23
"${pip[@]}" -r python/interop/requirements.txt -r python/interop/requirements-sched.txt "maturin>=1.9,<2"
(. "$venv/bin/activate" && maturin develop -q -m crates/kvbridge-py/Cargo.toml)
# In CI the suite must run, not skip for want of torch.
export KVB_REQUIRE_TORCH=1
# The Python package's own suite again, now with sglang importable: its
# backend tests (skipped in the plain venv) run against sglang's classes.
"$venv/bin/python" -m pytest -q -p no:cacheprovider crates/kvbridge-py/tests
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider python/interop/tests/test_sched.py "$@"
