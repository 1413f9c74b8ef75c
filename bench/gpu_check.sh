#!/usr/bin/env bash
# Issue 62's GPU steps on a lent machine (../shared/gpu/README.md), in the project root there. Made on the
# CPU machine by `bench/gpu_kit.py prepare` (.gpu-kit/) and tried there by `bench/gpu_kit.py check`.
#   call 1: run(command="bash bench/gpu_check.sh", carry=[".gpu-kit/wheels", ".gpu-kit/model-a"])
#           the wheels the machine lacks, installed once; the GGUF's first part kept; packing, quick start
#   call 2, at once (the machine's /tmp lasts while it stays warm):
#           run(command="bash bench/gpu_check.sh", carry=[".gpu-kit/model-b"])
#           the GGUF joined and checked; the real chat model; vLLM if ../shared/gpu's wheels are in /tmp/gsite
# Each step runs once (a stamp under $KIT/done; FORCE=1 runs them again) within its own time limit, in the
# order of the issue; every call ends with one table of all results so far (also under $OUT).
set -u
KIT=${ASYNCRL_KIT:-/tmp/asyncrl-kit}
OUT=${OUT:-$KIT/out}
DEVICE=${GPU_CHECK_DEVICE:-cuda}   # the CPU try: cpu, with small sizes (GPU_CHECK_SMALL=1)
SMALL=${GPU_CHECK_SMALL:-0}
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$KIT/results" "$KIT/done" "$KIT/model" "$KIT/logs" "$OUT"
export PYTHONUNBUFFERED=1

# 1. the wheels the machine lacks (pyzmq, pydantic, msgspec, crc32c, gguf...), installed once
SITE=${GPU_CHECK_SITE:-$KIT/site}
if [ -z "${GPU_CHECK_SITE:-}" ] && [ ! -e "$SITE/.installed" ] && ls .gpu-kit/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu-kit/wheels/*.whl \
    && touch "$SITE/.installed" || echo "=== wheels: install failed"
fi
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}

# 2. the GGUF's parts: kept until both are here, then joined and checked against its sha256
for f in .gpu-kit/model-*/*; do [ -f "$f" ] && cp "$f" "$KIT/model/"; done
if [ ! -f "$KIT/model/$MODEL" ] && [ -f "$KIT/model/$MODEL.part0" ] && [ -f "$KIT/model/$MODEL.part1" ]; then
  cat "$KIT/model/$MODEL.part0" "$KIT/model/$MODEL.part1" > "$KIT/model/$MODEL.tmp"
  (cd "$KIT/model" && mv "$MODEL.tmp" "$MODEL" && sha256sum -c "$MODEL.sha256") || { echo "=== model: sha256 differs"; rm -f "$KIT/model/$MODEL"; }
fi

{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, transformers, zmq, pydantic; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'pyzmq', zmq.__version__, 'pydantic', pydantic.__version__)"
} 2>&1 | tee "$OUT/card.txt"

step() {  # name, time limit (s), command...: once, bounded, its log's tail shown
  local name=$1 limit=$2; shift 2
  if [ -e "$KIT/done/$name" ] && [ "${FORCE:-0}" != 1 ]; then echo "=== $name: $(cat "$KIT/done/$name")"; return; fi
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$KIT/logs/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$KIT/logs/$name.log"
  echo "rc $rc in $((SECONDS - t0)) s (an earlier call)" > "$KIT/done/$name"
  echo "=== $name: rc $rc in $((SECONDS - t0)) s"
}

if [ "$SMALL" = 1 ]; then
  PACK=(--shape tiny --rows 16 --max-len 256 --steps 1)
  QS=(--steps 6 --timeout 240 train.device=$DEVICE engine.device=$DEVICE)
  REAL=(--steps 2 --device $DEVICE --dtype float32 --timeout 900 eval.size=8 tasks.eval_size=8)
else
  PACK=()
  QS=(--steps 30)
  REAL=(--steps 20)
fi
# the packed step's attention paths against padded (Qwen2.5-0.5B shapes, bf16, long-tailed rows)
step packing 240 python3 bench/bench_gpu.py packing "${PACK[@]}" --json "$KIT/results/packing.json"
step quickstart 150 python3 bench/bench_gpu.py quickstart --sync zmq --json "$KIT/results/quickstart.json" "${QS[@]}"
if [ -f "$KIT/model/$MODEL" ]; then
  step realmodel 420 python3 bench/bench_gpu.py realmodel --gguf "$KIT/model/$MODEL" --json "$KIT/results/realmodel.json" "${REAL[@]}"
else
  echo "=== realmodel: waiting for the GGUF's second part (carry .gpu-kit/model-b)"
fi
if [ -d /tmp/gsite ] && PYTHONPATH=/tmp/gsite:$PYTHONPATH python3 -c "import vllm" 2>/dev/null; then
  PYTHONPATH=/tmp/gsite:$PYTHONPATH VLLM_ENABLE_V1_MULTIPROCESSING=0 step vllm 240 python3 -m pytest -q -m gpu \
    -p no:cacheprovider tests/unit/engine/test_engine_vllm.py tests/unit/weights/test_sync_ipc_cuda.py
else
  echo "=== vllm: not installed in /tmp/gsite (../shared/gpu/fetch-wheels.sh, install.sh): left for a later call"
fi
cp -r "$KIT/results" "$KIT/logs" "$OUT/" 2>/dev/null
echo "=== results so far"
python3 bench/bench_gpu.py table --results "$KIT/results" | tee "$OUT/table.txt"
