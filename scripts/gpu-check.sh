#!/usr/bin/env bash
# make gpu-check: on a GPU machine, within 8 minutes: install the `gpu` extra from wheels
# carried along (.whl/), run the GPU tests (kernels compiled for real, the verifier's
# kernel path, TensorRT and CUDA providers) and the GPU benchmarks (kernels' share of
# the memory bandwidth peak, the Triton kernels against preprocessing inside the ONNX
# graph, TensorRT INT8 against CUDA FP32), and write everything to gpu-check-results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${GPU_CHECK_OUT:-gpu-check-results}"
mkdir -p "$OUT"
LOG="$OUT/gpu-check.log"
exec > >(tee -a "$LOG") 2>&1
deadline=$(( $(date +%s) + ${GPU_CHECK_BUDGET_S:-480} ))
left() { echo $(( deadline - $(date +%s) )); }
echo "== gpu-check $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia-smi.csv" || echo "no nvidia-smi"

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python
  else python3 -m venv .venv-gpu && PY=.venv-gpu/bin/python; fi
fi
PIP=("$PY" -m pip --disable-pip-version-check -q)
if [ -d .whl ]; then
  # Offline: the GPU machine reaches nothing outside, so every wheel travels in .whl/.
  timeout "$(( $(left) / 2 ))" "${PIP[@]}" install --no-index --find-links .whl -e ".[gpu,dev]" \
    || echo "warning: installing the gpu extra from .whl/ failed; testing what is installed"
else
  echo "no .whl/ folder: testing what is installed"
fi
"$PY" - <<'PYEOF' | tee "$OUT/environment.txt"
import importlib
for name in ("torch", "triton", "onnxruntime", "tensorrt"):
    try:
        m = importlib.import_module(name); print(name, getattr(m, "__version__", "?"))
    except Exception as exc:
        print(name, "missing:", exc)
import onnxruntime as ort; print("ort providers", ort.get_available_providers())
import torch; print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PYEOF

status=0
TRITON_INTERPRET=0 timeout "$(( $(left) * 2 / 3 ))" "$PY" -m pytest tests/kernels tests/gpu -q -p no:cacheprovider \
  --junitxml="$OUT/pytest.xml" -o addopts="-ra --strict-config" || status=$?
echo "pytest exit: $status"
TRITON_INTERPRET=0 timeout "$(( $(left) > 30 ? $(left) - 10 : 20 ))" "$PY" -m bench.run --only gpu \
  || status=$?
cp bench/results/latest.json "$OUT/bench-gpu.json" 2>/dev/null || true
cp bench/results/latest.md "$OUT/bench-gpu.md" 2>/dev/null || true
echo "== done, exit $status; results in $OUT/"
exit "$status"
