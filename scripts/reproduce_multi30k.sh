#!/usr/bin/env bash
# Reproduce the Transformer recipe at CPU scale: Multi30k German->English.
#   1. train experiment=multi30k_de_en (post-LN 3+3 layers, d_model 256, shared 8000 BPE, label smoothing 0.1,
#      Adam + inverse-sqrt schedule), writing a checkpoint every 250 steps to <run>/checkpoints/periodic;
#   2. average the last $AVG checkpoints (paper: 5);
#   3. beam search (beam 4, alpha 0.6, max length = source + 50) on test_2016_flickr, sacreBLEU + chrF.
# Results: <run>/translate/{hyps.txt,scores.json}; the BLEU line and its sacreBLEU signature are printed.
#
#   scripts/reproduce_multi30k.sh                                   # the full recipe (6000 steps)
#   SEED=1 RUN=outputs/m30k_s1 scripts/reproduce_multi30k.sh +trainer.max_time=00:02:00:00   # time-boxed
#   scripts/reproduce_multi30k.sh pe=learned                        # Table 3 row (E): learned positions
# Extra arguments go to posformer-train (Hydra overrides). Env: POSFORMER_DATA (folder holding multi30k/),
# RUN (run directory), SEED, AVG (checkpoints averaged), NICE (niceness, default 10).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${POSFORMER_DATA:-$(cd .. && pwd)/shared/data}
SEED=${SEED:-0}
AVG=${AVG:-5}
NICE=${NICE:-10}
RUN=${RUN:-outputs/multi30k_de_en/seed${SEED}-$(date +%Y%m%d-%H%M%S)}
BIN=$( [ -x .venv/bin/posformer-train ] && echo .venv/bin/ || echo "" )
if [ ! -e "$DATA/multi30k/train.de.gz" ] && [ ! -e "$DATA/multi30k/train.de" ]; then
  echo "error: no Multi30k under $DATA/multi30k (train.de[.gz] ...); set POSFORMER_DATA" >&2
  exit 1
fi
start=$(date +%s)
nice -n "$NICE" "${BIN}posformer-train" experiment=multi30k_de_en data.path="$DATA/multi30k" seed="$SEED" \
  hydra.run.dir="$RUN" "$@"
nice -n "$NICE" "${BIN}posformer-eval" eval=translate eval.run_dir="$RUN" eval.average_last="$AVG" \
  eval.beam_size=4 eval.alpha=0.6 eval.output_dir="$RUN/translate" hydra.run.dir="$RUN/translate"
echo "total wall time: $(( $(date +%s) - start )) s   run: $RUN"
