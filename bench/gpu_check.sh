#!/usr/bin/env bash
# Issue 50's steps on a lent GPU machine, as one prepared command (see ../shared/gpu/README.md):
#   bash bench/gpu_check.sh        (in the project root there; results under $OUT)
# The machine has torch + CUDA, transformers, numpy, msgpack...; the pure-Python dependencies it lacks
# (pyzmq, pydantic, msgspec) travel as wheels in .whl (carried). Each step is bounded and logged.
set -u
OUT=${OUT:-/tmp/asyncrl-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import zmq, pydantic, msgspec" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, transformers, zmq, pydantic; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'pyzmq', zmq.__version__, 'pydantic', pydantic.__version__)"
} 2>&1 | tee "$OUT/card.txt"
step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 30 "$OUT/$name.log"
  echo "=== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$OUT/card.txt"
}
step ipc 100 python3 bench/bench_gpu.py ipc --json "$OUT/ipc.json"
step packing 120 python3 bench/bench_gpu.py packing --json "$OUT/packing.json"
step gputests 110 python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
  tests/unit/sync/test_sync_ipc_cuda.py tests/unit/engine/test_engine_vllm.py
step quickstart 130 python3 bench/bench_gpu.py quickstart --steps 30 --json "$OUT/quickstart.json"
