"""Packs the interop suite for the GPU machine (``cargo xtask gpu-test``).

The GPU machine has CPython 3.12 with torch (CUDA), numpy, transformers,
Pillow, aiohttp, requests, psutil and tqdm, but no internet, no sglang and
no pyzmq. This script, run where PyPI is reachable, writes ``--out``:

* ``interop/``: this folder's harness and its ``tests/``;
* ``wheels/``: wheels for the GPU machine's Python (``--python-version``) of
  what the connector's import chain needs beyond what that machine has
  (``requirements.txt`` minus :data:`ON_DEVICE`), plus pytest, and the
  kvbridge wheel (abi3);
* ``sglang-src.zip``: sglang 0.5.23's wheel, byte for byte, minus its
  compiled extensions (the wheel is tagged cp311; the connector needs none
  of its ``.so`` files, so the rest imports on 3.12; with real torch the
  import chain resolves the JIT kernel sources' folder, so those stay);
  never edited;
* ``device_run.sh``: unpacks all of it and runs the suite on device tensors.

Downloads are cached in ``--cache``. Exit status non-zero, with the reason,
when anything is missing.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))

SGLANG = "sglang==0.5.23"

#: Requirements the GPU machine already has (checked there by device_run.sh
#: before the suite starts): left out of the wheel folder to keep the
#: bundle small.
ON_DEVICE = {"numpy", "transformers", "pillow", "mooncake-transfer-engine-non-cuda", "torch"}

#: Extra test tooling.
EXTRA = ["pytest==9.2.0"]


def requirements() -> list:
    """``requirements.txt`` and ``requirements-sched.txt`` pins (the
    real-scheduler suite's), minus what the GPU machine has."""
    out = []
    for name in ("requirements.txt", "requirements-sched.txt"):
        with open(os.path.join(HERE, name)) as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                if line and line.split("==")[0].lower() not in ON_DEVICE and line not in EXTRA:
                    out.append(line)
    return out + EXTRA


def pip_download(dest: str, args: list) -> None:
    os.makedirs(dest, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", dest] + args
    print("gpu_pack:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def binary_args(python_version: str) -> list:
    args = ["--only-binary=:all:", "--python-version", python_version]
    for tag in ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64"):
        args += ["--platform", tag]
    return args


def sglang_sources(cache: str, out_zip: str) -> int:
    """Writes sglang's wheel minus its ``.so`` files to ``out_zip``;
    returns how many files."""
    pip_download(os.path.join(cache, "sglang"), ["--no-deps", SGLANG] + binary_args("3.11"))
    wheels = glob.glob(os.path.join(cache, "sglang", "sglang-0.5.23-*.whl"))
    if not wheels:
        raise SystemExit("gpu_pack: no sglang 0.5.23 wheel was downloaded")
    n = 0
    with zipfile.ZipFile(wheels[0]) as src, zipfile.ZipFile(out_zip, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            name = info.filename
            if not name.endswith(".so"):
                dst.writestr(info, src.read(info))
                n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder to write (replaced)")
    ap.add_argument("--kvbridge-wheel", required=True, help="the kvbridge wheel (abi3) to ship")
    ap.add_argument("--cache", required=True, help="download cache")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's CPython (default 3.12)")
    args = ap.parse_args(argv)

    shutil.rmtree(args.out, ignore_errors=True)
    wheels = os.path.join(args.out, "wheels")
    os.makedirs(wheels)
    shutil.copytree(HERE, os.path.join(args.out, "interop"),
                    ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.pyc", ".ruff_cache"))
    os.replace(os.path.join(args.out, "interop", "device_run.sh"), os.path.join(args.out, "device_run.sh"))

    cached = os.path.join(args.cache, f"py{args.python_version}")
    pip_download(cached, requirements() + binary_args(args.python_version))
    for w in glob.glob(os.path.join(cached, "*.whl")):
        dist = os.path.basename(w).split("-")[0].lower().replace("_", "-")
        if dist not in ON_DEVICE:
            shutil.copy(w, wheels)
    shutil.copy(args.kvbridge_wheel, wheels)
    n = sglang_sources(args.cache, os.path.join(args.out, "sglang-src.zip"))

    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.out) for f in fs)
    print(f"gpu_pack: {args.out}: {len(os.listdir(wheels))} wheels, {n} sglang files, "
          f"{size / 2**20:.1f} MiB in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
