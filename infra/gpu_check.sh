#!/usr/bin/env bash
# The vLLM / SGLang checks, on a GPU machine where both engines are installed
# (pip install -e '.[dev,sglang]' and '.[vllm]', or the engines' own images). Finishes in under 8 minutes:
# starts each engine on a keyframe of the tiny test model (no downloads), runs `pytest -m gpu`,
# and stops both engines whatever happens. Usage: infra/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=$(mktemp -d)
SGLANG_PORT=${SGLANG_PORT:-30100}
VLLM_PORT=${VLLM_PORT:-30200}
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  sleep 2
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

python -m infra.tiny_checkpoint "$WORK/model" >/dev/null

python -m sglang.launch_server --model-path "$WORK/model/v0" --host 127.0.0.1 --port "$SGLANG_PORT" \
  --skip-tokenizer-init --enable-return-routed-experts --weight-version 0 --mem-fraction-static 0.3 \
  --disable-cuda-graph >"$WORK/sglang.log" 2>&1 &
pids+=($!)

VLLM_SERVER_DEV_MODE=1 vllm serve "$WORK/model/v0" --host 127.0.0.1 --port "$VLLM_PORT" \
  --skip-tokenizer-init --tokens-only --enable-return-routed-experts --return-sampling-mask \
  --logprobs-mode processed_logprobs --max-model-len 1024 --gpu-memory-utilization 0.3 --enforce-eager \
  >"$WORK/vllm.log" 2>&1 &
pids+=($!)

wait_healthy() {  # name url deadline_s
  local deadline=$((SECONDS + $3))
  until curl -sf "$2/health" >/dev/null; do
    if ((SECONDS > deadline)); then echo "$1 did not become healthy; log: $WORK/$1.log"; tail -20 "$WORK/$1.log"; exit 1; fi
    sleep 2
  done
  echo "$1 healthy at $2"
}
wait_healthy sglang "http://127.0.0.1:$SGLANG_PORT" 240
wait_healthy vllm "http://127.0.0.1:$VLLM_PORT" 240

SPRAWL_TEST_MODEL_DIR="$WORK/model" \
SPRAWL_TEST_SGLANG_URL="http://127.0.0.1:$SGLANG_PORT" \
SPRAWL_TEST_VLLM_URL="http://127.0.0.1:$VLLM_PORT" \
  timeout 240 python -m pytest -m gpu tests/test_gpu_engines.py -v
