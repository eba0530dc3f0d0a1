#!/usr/bin/env bash
# Device call 3 on the still-warm machine: resume the training in /root/r/train_$EST for MORE_S seconds, send it back.
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE PYTHONPATH=/root/site:$PWD
R=/root/r; EST=${EST:-grpo}; MORE_S=${MORE_S:-120}
OV="serving.actor.device=cuda serving.actor.max_batch_size=64 serving.actor.threads=2 env.aflow.eval_concurrency=64 sandbox.allow_unisolated=true $EXTRA"
ls $R/train_$EST/checkpoints
timeout -s INT $MORE_S python3 train.py configs/aflow_smol.yaml $OV run.dir=$R/train_$EST trainer.max_steps=400 \
  trainer.save_every=1 algo.adv_estimator=$EST $TRAIN_EXTRA > $R/train_${EST}_more.log 2>&1
echo "train exit $?"; tail -c 1500 $R/train_${EST}_more.log
tar czf $OUT/run_$EST.tgz -C $R train_$EST train_$EST.log train_${EST}_more.log; ls -la $OUT
