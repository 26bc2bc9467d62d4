#!/bin/bash
# The one-call GPU check (issue 54) on a machine with one H100 / H200 and no internet: prints what the machine is
# (nvidia-smi, Python, torch, CUDA), makes the project importable from this checkout (the packages the machine lacks
# come from the wheels `python bench/gpu_check.py --prepare .gpu_check` downloaded beforehand; the package itself from
# this checkout, by PYTHONPATH: nothing is built or fetched), then runs bench/gpu_check.py with the arguments given
# (default budget 540 s for its parts: the whole call fits the device tool's 10-minute command). The JSON goes to bench/results/gpu/ and,
# where $OUT is set (the GPU machine's folder that comes back), is copied there with each part's log.
# Usage: [GPU_CHECK_COMMIT=<commit>] [GPU_CHECK_INPUTS=.gpu_check] bash bench/gpu_check.sh [gpu_check.py options]
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
INPUTS=${GPU_CHECK_INPUTS:-.gpu_check}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
echo "== nvidia-smi"
nvidia-smi || echo "(nvidia-smi not found or failed)"
echo "== $($PY --version 2>&1) at $(command -v "$PY")"
$PY -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| available', torch.cuda.is_available())" \
  || { echo "torch is not importable with $PY"; exit 1; }
if ! $PY -c "import jsonargparse, docstring_parser, typeshed_client, gguf" 2>/dev/null; then
  if ls "$INPUTS"/wheels/*.whl >/dev/null 2>&1; then
    echo "== installing $(ls "$INPUTS"/wheels | tr '\n' ' ')into /tmp/gpu_check_site"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
      "$INPUTS"/wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "missing packages and no wheels in $INPUTS/wheels: trying pip install -e . (needs an index)"
    $PY -m pip install -q -e . || exit 1
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import iprox_lightning, lightning, transformers, jsonargparse; print('iprox_lightning from', iprox_lightning.__file__, '| lightning', lightning.__version__, '| transformers', transformers.__version__, '| jsonargparse', jsonargparse.__version__)" \
  || exit 1
$PY bench/gpu_check.py ${OUT:+--copy-to "$OUT"} "$@"
