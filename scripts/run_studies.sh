#!/usr/bin/env bash
# The studies of docs/leaderboard.md, in order, one run per core. Every step is resumable (finished runs
# are skipped, interrupted runs resume from their last checkpoint, a finished evaluation is not redone,
# finished translations are cached): re-run this script to continue. The algorithmic and Multi30k studies
# also record every finished run in docs/studies/<study>/ (posformer/studies/ledger.py): commit those records,
# and a fresh clone continues the study and rebuilds its tables without the outputs/ of earlier machines.
#   scripts/run_studies.sh                  # everything, cores 0 and 1 (many hours on a 2-core CPU)
#   CORES=0 STUDIES="lm" scripts/run_studies.sh
#   LAUNCH_FOR=120 STUDIES="reverse sort" scripts/run_studies.sh   # start no run after 2 h, record the rest
# Env: PY (python), CORES (comma-separated), STUDIES (subset of: lm reverse multi30k sort),
#      LAUNCH_FOR (minutes from now, for the whole script: every study starts no training run after it,
#      then evaluates, records and summarises what finished (the LM study records each run as it
#      finishes); a Multi30k run takes about an hour on one core, an LM run 9-25 minutes, an
#      algorithmic one about 8 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
CORES=${CORES:-0,1}
STUDIES=${STUDIES:-lm reverse multi30k sort}
# bad input: one line, before any work starts
for study in $STUDIES; do
  case $study in lm|reverse|multi30k|sort) ;;
    *) echo "error: STUDIES contains '$study'; valid: lm reverse multi30k sort" >&2; exit 2 ;;
  esac
done
if [ -n "${LAUNCH_FOR:-}" ] && ! [[ $LAUNCH_FOR =~ ^[0-9]+$ ]]; then
  echo "error: LAUNCH_FOR=$LAUNCH_FOR; give whole minutes, e.g. LAUNCH_FOR=120" >&2; exit 2
fi
END=$(( $(date +%s) + ${LAUNCH_FOR:-0} * 60 ))
for study in $STUDIES; do
  echo "=== $study  $(date -u +%FT%TZ)"
  WINDOW=()
  if [ -n "${LAUNCH_FOR:-}" ]; then
    left=$(( (END - $(date +%s)) / 60 ))
    WINDOW=(--launch-for "$(( left > 0 ? left : 0 ))")
  fi
  case $study in
    lm) $PY scripts/study_lm_extrapolation.py --size small --seeds 0 1 2 --out outputs/studies/lm_small \
          --ledger docs/studies/lm_small --cores "$CORES" "${WINDOW[@]}" ;;
    multi30k) $PY scripts/study_multi30k.py --pes sinusoidal learned rope --seeds 0 1 2 --steps 2500 \
          --out outputs/studies/multi30k --ledger docs/studies/multi30k --cores "$CORES" "${WINDOW[@]}" ;;
    reverse|sort) $PY scripts/study_algorithmic.py --size small --task "$study" --seeds 0 1 2 --stop-at 0.98 \
          --val-every 250 --out "outputs/studies/algorithmic_${study}_small" \
          --ledger "docs/studies/algorithmic_${study}_small" --cores "$CORES" "${WINDOW[@]}" ;;
  esac
done
echo "=== all done  $(date -u +%FT%TZ)"
