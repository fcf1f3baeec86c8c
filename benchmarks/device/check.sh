#!/usr/bin/env bash
# Issue 20's GPU checks, in one call to a lent GPU machine (prepare the wheels here first: wheels.sh):
#
#     run(command="bash benchmarks/device/check.sh", carry=[".whl"], timeout_s=600)
#
# Installs the carried wheels beside the image's PyTorch, makes the package importable as setuptools maps it (no
# install: stratamesh.fleet is fleet/, and so on), then runs the gpu-marked tests and benchmarks/gpu_serving.py, each
# under a limit that leaves the whole call inside one command's 10 minutes. Logs go to $OUT; the reply's tail is
# the benchmark's table. Pass --quick to run the benchmark's tiny model instead (a minute: does it run at all?).
set -uo pipefail
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the carried wheels did not install: run benchmarks/device/wheels.sh and carry .whl"; exit 3; }
mkdir -p /tmp/pkg/stratamesh
for f in stratamesh/*; do ln -sfn "$PWD/$f" /tmp/pkg/stratamesh/; done
for d in fleet agent coordinator partitioner kernels; do ln -sfn "$PWD/$d" "/tmp/pkg/stratamesh/$d"; done
export PYTHONPATH=/tmp/pkg:/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
{ nvidia-smi; python3 -c "import torch, triton, grpc; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
  torch.cuda.get_device_name(0), 'triton', triton.__version__, 'grpc', grpc.__version__)"; } > "$OUT/device.txt" 2>&1
tail -1 "$OUT/device.txt"
timeout 240 python3 -m pytest -m gpu -q -ra -p no:cacheprovider -p pytest_asyncio.plugin -p pytest_timeout \
    tests/agent/test_decode_graphs.py tests/agent/test_gpu_stage.py tests/agent/test_speed.py \
    tests/kernels/test_mixed_dtypes.py tests/kernels/test_tp.py tests/kernels/test_triton_decode.py \
    tests/kernels/test_sampler.py \
    > "$OUT/pytest-gpu.log" 2>&1
echo "pytest -m gpu: exit $? ($(tail -1 "$OUT/pytest-gpu.log"))"
timeout 330 python3 benchmarks/gpu_serving.py "$@" > "$OUT/gpu_serving.log" 2>&1
echo "gpu_serving.py: exit $?"
grep -v "^WARNING\|^INFO" "$OUT/gpu_serving.log" | tail -40
