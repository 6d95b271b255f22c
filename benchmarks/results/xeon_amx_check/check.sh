#!/usr/bin/env bash
# The check behind this folder, run on a bare machine with no network: the README's test
# command on that machine's CPU (flags printed), then five worker races side by side.
# Usage: bash check.sh WHEELS_DIR OUT_DIR   (WHEELS_DIR: the wheels of what the machine lacks:
# optuna and its needs, onnxruntime 1.32, optuna-dashboard, bottle, nncf, cmaes, plus an
# unpacked-openvino tarball ov_pruned.tar.xz)
set -u
wheels=$1; out=$2
export PYTHONUNBUFFERED=1
grep -m1 'model name' /proc/cpuinfo; nproc
grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -xE 'avx2|avx512f|avx512_vnni|avx_vnni|avx512_bf16|amx_bf16|amx_int8|amx_tile' | tr '\n' ' '; echo
SP=$(python3 -c 'import site;print(site.getsitepackages()[0])')
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade "$wheels"/*.whl || exit 3
tar xJf "$wheels"/ov_pruned.tar.xz -C "$SP" || exit 4
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || export PYTHONPATH=$PWD
python3 -c "import onnx, onnxruntime, openvino, optuna, nncf, optuna_dashboard; print('onnx', onnx.__version__, 'ort', onnxruntime.__version__, 'ov', openvino.__version__, 'optuna', optuna.__version__, 'nncf', nncf.__version__)"
python3 -c "from qdq_optuna.machine import current_cpu; print('qdq_optuna sees:', current_cpu().describe())"
mkdir -p "$out"
set -o pipefail
timeout 300 python3 -m pytest -q -p no:cacheprovider --maxfail=60 2>&1 | tee "$out"/pytest.log | tail -45
echo "suite rc=$?"
for i in 1 2 3 4 5; do
  timeout 170 python3 benchmarks/worker_race.py --runs 10 --out "$out"/race$i.json > "$out"/race$i.log 2>&1 &
done
wait
cat "$out"/race*.log | grep -E "run |failed"
