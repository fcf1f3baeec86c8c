#!/usr/bin/env bash
# Downloads, here, the wheels a lent GPU machine lacks to run the mesh (benchmarks/device/check.sh installs them there).
#
#     bash benchmarks/device/wheels.sh        # into .whl/ (git ignores it), then: run(..., carry=[".whl"])
#
# The device image has Python 3.12, PyTorch, Triton, transformers, safetensors, tokenizers, onnxruntime, numpy,
# httpx, prometheus-client, jinja2 and nvidia-ml-py (/work/.library/device/KINDS.md lists it), and nothing can be
# fetched there. These are the rest of pyproject's dependencies and the tests' plugins, at the versions this
# checkout's .venv runs (what CI tests), for CPython 3.12 on x86-64. aiortc and libav stay behind (36 MB, over the
# 64 MiB a call carries): a daemon imports them only to reach a peer behind NAT (fleet/wire/rtc.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
PACKAGES=(grpcio protobuf zeroconf ifaddr pydantic pydantic_core annotated-types typing-inspection typing_extensions
          sqlite-utils sqlite-fts4 click-default-group click tabulate fastapi starlette anyio annotated-doc uvicorn h11
          cryptography cffi pycparser opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
          uvloop pytest pluggy iniconfig pytest-asyncio pytest-timeout)
rm -rf .whl && mkdir .whl
for name in "${PACKAGES[@]}"; do
    version=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl "$name==$version"
done
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (with the checkout, under the 64 MiB a call carries)"
