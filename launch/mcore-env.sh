#!/usr/bin/env bash
# launch/mcore-env.sh VERSION DIR — a Python 3.11 venv at DIR whose megatron-core is VERSION (e.g. 0.19.2),
# for running the orchestrator against a newer megatron-core than the system's 0.16.1.
#
# megatron-core >= 0.17 declares Python >= 3.12, so pip will not install it here, but its Python files run
# on 3.11. So: a venv that sees the system site-packages (torch, hydra, submitit, the orchestrator install),
# the cp312 wheel's files unpacked into the venv's site-packages (they shadow the system megatron-core,
# .dist-info included, so importlib.metadata reports VERSION), helpers_cpp rebuilt for 3.11 from the
# wheel's own helpers.cpp, and PyPI's triton (0.19.x imports it unconditionally) without its deps.
#
#   bash launch/mcore-env.sh 0.19.2 /opt/mcore-0.19.2          # ~45 s, ~1.1 GB (triton is 1 GB of it)
#   PYTHONPATH=$PWD /opt/mcore-0.19.2/bin/python -m orchestrator +experiment=gpt_pp2_dp2 ...
#
# Re-running on a good DIR exits at once. TRITON_VERSION overrides the triton pin.
set -euo pipefail

VERSION=${1:?usage: mcore-env.sh VERSION DIR}
DIR=${2:?usage: mcore-env.sh VERSION DIR}
TRITON_VERSION=${TRITON_VERSION:-3.9.0}  # has cp311 manylinux wheels; --no-deps so it pulls no torch
SYS_PY=${SYS_PY:-python3}
PY="$DIR/bin/python"

t0=$SECONDS; t=$SECONDS
step() { echo "[mcore-env] $1 ($((SECONDS - t)) s)"; t=$SECONDS; }

# Idempotent: DIR is done when megatron-core VERSION (files + dist-info), helpers_cpp and triton are in
# place, checked without importing megatron.core (~10 s; the last step of a build does import it).
READY='
import glob, os, sys, importlib.metadata as md, importlib.util as iu
core = os.path.dirname(iu.find_spec("megatron.core").origin)
assert core.startswith(sys.prefix) and md.version("megatron-core") == sys.argv[1] and md.version("triton")
assert glob.glob(os.path.join(core, "datasets", "helpers_cpp.cpython-311-*.so"))'
# The unpacked wheel's files are byte-compiled here, once (pip is not what installs them, so nothing else
# does): otherwise a process that may not write bytecode (PYTHONDONTWRITEBYTECODE) compiles every megatron
# module it imports, 0.5-0.6 CPU-s of a rank's 3.8 (forked.preload, 0.19.2). Up to date: ~0.1 CPU-s.
compile_megatron() { "$PY" -m compileall -q -j 0 "$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/megatron" >/dev/null; }
if [[ -x "$PY" ]] && "$PY" -c "$READY" "$VERSION" 2>/dev/null; then
  compile_megatron
  echo "[mcore-env] $DIR already has megatron-core $VERSION; nothing to do"; exit 0
fi

# 1. The venv, on top of the system site-packages (its torch and megatron-core must import already).
"$SYS_PY" -c "import torch, megatron.core" 2>/dev/null \
  || { echo "[mcore-env] the system Python cannot import torch + megatron.core yet" >&2; exit 1; }
"$SYS_PY" -m venv --system-site-packages "$DIR"
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
step "venv at $DIR"

# 2. The cp312 manylinux x86_64 wheel, unpacked into the venv's site-packages.
WHEELS=$(mktemp -d); trap 'rm -rf "$WHEELS"' EXIT
"$PY" -m pip download --quiet --no-deps --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --dest "$WHEELS" "megatron-core==$VERSION"
WHEEL=$(ls "$WHEELS"/megatron_core-"$VERSION"-cp312-*x86_64*.whl)
rm -rf "$SITE/megatron" "$SITE"/megatron_core-*.dist-info
"$PY" -m zipfile -e "$WHEEL" "$SITE"   # megatron/ and megatron_core-VERSION.dist-info/
rm -f "$SITE"/megatron/core/datasets/helpers_cpp.cpython-312-*.so
compile_megatron
step "megatron-core $VERSION unpacked ($(basename "$WHEEL")) and byte-compiled"

# 3. helpers_cpp for this Python, from the wheel's own helpers.cpp.
"$PY" -m pip install --quiet pybind11
( cd "$SITE/megatron/core/datasets"
  EXT=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  g++ -O3 -shared -fPIC -std=c++17 $("$PY" -m pybind11 --includes) helpers.cpp -o "helpers_cpp$EXT" )
step "helpers_cpp rebuilt"

# 4. triton from PyPI, without its dependencies (the system torch stays the only torch).
"$PY" -m pip install --quiet --no-deps "triton==$TRITON_VERSION"
step "triton $TRITON_VERSION"

# 5. Import it for real: megatron-core VERSION from DIR (not the system's), its helpers, triton.
CHECK='
import sys, importlib.metadata as md
import megatron.core, triton
from megatron.core.datasets import helpers_cpp
assert megatron.core.__version__ == md.version("megatron-core") == sys.argv[1], megatron.core.__version__
print("[mcore-env] megatron.core", megatron.core.__version__, "from", megatron.core.__file__)'
"$PY" -c "$CHECK" "$VERSION" 2>/dev/null \
  || { echo "[mcore-env] $DIR does not import megatron-core $VERSION" >&2; exit 1; }
step "imports checked"
echo "[mcore-env] done in $((SECONDS - t0)) s; $(du -sh "$DIR" | cut -f1) in $DIR"
