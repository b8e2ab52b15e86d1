#!/usr/bin/env bash
# GPU check, for a machine with CUDA: the gpu-marked tests (the engine on the GPU against Hugging Face),
# the Triton kernel tests compiled for the device instead of interpreted, and compare_peers of Ember and
# transformers on the GPU. Everything it prints also goes to $OUT/gpu_check.log (OUT defaults to
# ./gpu-check-out). Needs a Python with torch (CUDA build), triton and transformers; Ember's other
# dependencies come from an offline wheel folder when EMBER_WHEELHOUSE names one (no network needed).
#
#   bash tools/gpu_check.sh            # or: EMBER_WHEELHOUSE=wheels bash tools/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
PY=${PYTHON:-python3}
if [ -n "${EMBER_WHEELHOUSE:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/ember-site "$EMBER_WHEELHOUSE"/*.whl || exit 1
    export PYTHONPATH=/tmp/ember-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
status=0

echo "== gpu tests and Triton kernels on the device"
timeout 420 $PY -m pytest -q -p no:cacheprovider tests/workers/test_gpu.py \
    tests/kernels/test_decode_attention.py tests/kernels/test_prefill_attention.py \
    tests/kernels/test_kv_write.py tests/kernels/test_int4_matmul.py tests/kernels/test_backend.py \
    -s -k "${GPU_TESTS:-}" 2>&1 | grep -v "it/s]" | tail -60 || status=1

echo "== compare_peers on the GPU (random-weight Llama, bf16)"
MODEL=${GPU_BENCH_MODEL:-/tmp/ember-gpu-llama-medium}
[ -f "$MODEL/config.json" ] || $PY -m frontend.cli make-model "$MODEL" --arch llama --size medium --dtype bfloat16 >/dev/null
for n in 32 256; do
    timeout 240 $PY -m tools.compare_peers --model "$MODEL" --device cuda --peers ember,transformers \
        --num-prompts $n --work-dir /tmp/ember-peers --result-json "$OUT/peers_b$n.json" || status=1
done
exit $status
