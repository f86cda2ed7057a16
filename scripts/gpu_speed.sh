#!/usr/bin/env bash
# scripts/gpu_speed.sh: the CUDA speed measurements on one GPU, prepared on the CPU (--dry-run). Run in
# a device call of its own it lands on a fresh machine: it first installs what the image lacks, as the
# GPU check's setup does (scripts/gpu_setup.sh; the wheels carried as .whl/, into GPU_SPEED_SITE).
#
#   scripts/gpu_speed.sh [DIR]            # default DIR: outputs/gpu_speed/<date-time>/
#   scripts/gpu_speed.sh --dry-run [DIR]  # every stage's command; runs nothing, needs no GPU
#   GPU_SPEED_STAGES=t,m2 scripts/gpu_speed.sh DIR   # some stages only
#   bash scripts/gpu_speed.sh $OUT/gpu_speed         # device tool: bench.{json,md} + logs come back
#
# Stages (each under `timeout`, its budget in seconds; env <ID>_BUDGET_S):
#   q   posformer-bench --quick --device cuda: every PE and section (train, mfu, eval, gen) on a tiny
#       model, against x-transformers when it is installed: the benchmark's smoke test             150
#   t   the CUDA tests of the learned-bias Flex path, the fused optimiser and the PEs' shortcuts
#       (tests/model/test_flex_learned.py, test_bench_mfu.py, test_shaw_flex_shortcut.py, test_shaw_training.py,
#       test_shaw_masked.py, test_keycol.py, test_cope_shortcut.py, test_cope_training.py,
#       test_pe_precision.py, test_host_sync.py, test_fp16_scaler.py, test_small_heads.py, -m cuda):
#       parameter gradients through Flex = the float64 reference; shortcuts = explicit path; Shaw's
#       and CoPE's training gradients through their own attention = float64; the key column =
#       float64; every PE's position term under bf16 autocast = float32; posformer-train steps with
#       no synchronising CUDA call                                                                  210
#   tr  training tok/s, every bias PE side by side with nope (and x-transformers when installed):
#       d1024, 16 heads, 4 layers, T2048, batch 4, bf16, 3 reps; targets: every bias PE >= 0.85 x nope,
#       >= 1.3 x x-transformers                                                                     240
#   fo  ALiBi, T5 and KERPLE training through Flex: the captured offset vector (one gather per score, the
#       default) against each PE's bias_fn per score (--before flex_offsets; ALiBi: slope·(j - i)),
#       side by side: which form item 2 ("static biases near nope") should keep                    150
#   kc  ALiBi and forget-ALiBi training through Flex against their key bias as head-dim columns of the
#       fused SDPA kernel nope runs (--before flex; bf16: three split columns, Dh 64 -> 72), side by
#       side: whether item 2 should send them to the columns instead                                 120
#   fd  ALiBi, T5 and FIRE training through Flex at T2048: the dynamic-shape kernel told the lengths are
#       multiples of 128 (IS_DIVISIBLE: no per-tile bounds checks, as a static compile; the default)
#       against the one that checks every tile (--before flex_divisible)                          120
#   sh  Shaw's and CoPE's training through their own attention (Shaw: Flex for the far keys; CoPE:
#       its row-block function) against the explicit softmax / masked path (--before shortcut)   150
#   ev  64k-token evaluation (one no-grad forward, d1024) of every PE: the ones Flex computes
#       (forget-ALiBi's gates too), Shaw (its region shortcut) and CoPE (its saturation shortcut):
#       Flex for the far keys, an explicit band; xPos centred; within 3 x ALiBi and 40 GB           150
#   m1  MFU of nope/rope/alibi/t5 at d1024 (4 layers, T2048, batch 4) vs the same-run bf16 matmul     90
#   m2  the same at d2048, 8 layers (target: >= 45% for each)                                       120
#   mc  m2 with torch.compile of the whole model (compile.enabled=true's measurement)               180
# All eleven take ~27 min: on the device tool (10 min a call) as four calls: q,tr,ev,sh; m1,m2,mc; t,fo; kc,fd.
# Stages run in the order GPU_SPEED_STAGES lists them (put the most wanted first). GPU_SPEED_BUDGET_S
# (default: none) is a global budget: each stage's timeout is cut to what is left (less 10 s), and a
# stage with less than 30 s left is SKIPPED, so a short device lease still returns the first stages:
#   GPU_SPEED_STAGES=tr,kc,fd,fo,ev,m2 GPU_SPEED_BUDGET_S=240 bash scripts/gpu_speed.sh $OUT/gpu_speed
# TR_PES narrows stage tr (each bias PE compiles its own Flex kernels first), e.g. nope,alibi,t5,fire:
# a static offset bias, a learned one and a learned elementwise one against nope.
# Output: DIR/<stage>/ (bench.json with every repetition, bench.md), DIR/logs/<stage>.log, DIR/summary.md;
# the exit status is 0 only if every selected stage passed.
set -u
DRY_RUN=${GPU_SPEED_DRY_RUN:-0}
DIR=""
for arg in "$@"; do
    case $arg in
        --dry-run) DRY_RUN=1 ;;
        -h | --help) sed -n '2,/^set -u$/p' "$0" | sed '$d'; exit 0 ;;
        *) DIR=$arg ;;
    esac
done
DIR=${DIR:-outputs/gpu_speed/$(date +%Y%m%d-%H%M%S)}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
ALL_STAGES=q,t,tr,fo,kc,fd,sh,ev,m1,m2,mc
STAGES=${GPU_SPEED_STAGES:-$ALL_STAGES}
BUDGET=${GPU_SPEED_BUDGET_S:-}  # global budget in seconds (empty: none)
for id in ${STAGES//,/ }; do
    if [[ ",$ALL_STAGES," != *",$id,"* ]]; then
        echo "gpu_speed.sh: GPU_SPEED_STAGES=$STAGES: unknown stage '$id'; stages: $ALL_STAGES" >&2
        exit 2
    fi
done
if [ -n "$BUDGET" ] && ! [[ "$BUDGET" =~ ^[0-9]+$ ]]; then
    echo "gpu_speed.sh: GPU_SPEED_BUDGET_S=$BUDGET: must be a whole number of seconds (or unset: none)" >&2
    exit 2
fi
if [ "$DRY_RUN" = 0 ]; then  # a fresh machine: the wheels, posformer, the imports (scripts/gpu_setup.sh)
    # shellcheck source=scripts/gpu_setup.sh
    source "$(dirname "$0")/gpu_setup.sh"
    gpu_setup "$PYTHON" "${GPU_SPEED_SITE:-/tmp/site}" ||
        { echo "gpu_speed.sh: set-up failed (above); nothing measured" >&2; exit 2; }
fi
BENCH=("$PYTHON" -m posformer.cli.bench --device cuda --dtype bf16 --attention-backend auto)
# x-transformers' columns when it is installed (the dry run always shows them: nothing is imported)
[ "$DRY_RUN" = 1 ] || "$PYTHON" -c 'import x_transformers' 2>/dev/null || BENCH+=(--no-compare)
BIAS_PES=alibi,t5,kerple,fire,dpb,sandwich,cope,forget_alibi,shaw,content_rel
FLEX_PES=alibi,t5,kerple,fire,dpb,sandwich,forget_alibi  # the biases FlexAttention computes (64k evaluation)
# every PE at 64k: fused SDPA (xPos centred), the Flex biases, and Shaw and CoPE, whose no-grad
# shortcuts run their far keys on Flex (learned: n/a with its table's reason)
EVAL_PES=nope,pope,learned,sinusoidal,rope,xpos,$FLEX_PES,shaw,cope,content_rel
MODEL=(--d-model 1024 --n-heads 16 --n-layers 4 --seq-len 2048 --batch 4 --warmup 1 --reps 3)
MFU=(--sections mfu --mfu-pes nope,rope,alibi,t5 --n-heads 16 --seq-len 2048 --batch 4 --warmup 2 --reps 5)
SUMMARY=$DIR/summary.md

stage() {  # stage ID BUDGET_S TITLE -- COMMAND...
    local id=$1 budget=$2 title=$3
    shift 4
    if [ "$DRY_RUN" = 1 ]; then
        printf '== %s (%s s): %s\n   $ %s\n' "$id" "$budget" "$title" "$*"
        return 0
    fi
    if [ -n "$BUDGET" ]; then  # the global budget: cut this stage's timeout to what is left
        local left=$((BUDGET - SECONDS))
        if [ "$left" -lt 30 ]; then
            printf '| %s | SKIPPED | 0 | %s (%s s of GPU_SPEED_BUDGET_S left) |\n' "$id" "$title" "$left" >>"$SUMMARY"
            return 0
        fi
        [ "$budget" -gt $((left - 10)) ] && budget=$((left - 10))
    fi
    mkdir -p "$DIR/logs" "$DIR/$id"
    local t0=$SECONDS status
    timeout --kill-after=10 "$budget" "$@" >"$DIR/logs/$id.log" 2>&1
    case $? in
        0) status=passed ;;
        124 | 137) status=TIMEOUT ;;
        *) status=FAILED ;;
    esac
    printf '| %s | %s | %s | %s |\n' "$id" "$status" "$((SECONDS - t0))" "$title" >>"$SUMMARY"
    tail -n 3 "$DIR/logs/$id.log"
}

if [ "$DRY_RUN" = 0 ]; then
    mkdir -p "$DIR"
    {
        echo "# gpu_speed.sh $(date -u '+%Y-%m-%d %H:%M UTC')"
        "$PYTHON" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())' 2>&1
        echo
        echo "| stage | status | seconds | what |"
        echo "|---|---|---|---|"
    } >"$SUMMARY"
fi

run_q() {
    stage q "${Q_BUDGET_S:-150}" "posformer-bench --quick: every PE and section, tiny model" -- \
        "$PYTHON" -m posformer.cli.bench --quick --device cuda --out "$DIR/q"
}
run_t() {
    stage t "${T_BUDGET_S:-210}" "CUDA tests: learned-bias gradients through Flex, fused AdamW, shortcuts, no host sync" -- \
        "$PYTHON" -m pytest tests/model/test_flex_learned.py tests/bench/test_bench_mfu.py tests/pe/test_shaw_flex_shortcut.py \
        tests/pe/test_shaw_training.py tests/pe/test_shaw_masked.py tests/model/test_keycol.py tests/pe/test_cope_shortcut.py \
        tests/pe/test_cope_training.py tests/pe/test_pe_precision.py tests/lit/test_host_sync.py tests/lit/test_fp16_scaler.py tests/model/test_small_heads.py -m cuda -q -p no:cacheprovider \
        -rfE --tb=short --junitxml "$DIR/t/cuda_tests.xml"
}
run_tr() {
    stage tr "${TR_BUDGET_S:-240}" "training tok/s, bias PEs vs nope (vs x-t)" -- \
        "${BENCH[@]}" "${MODEL[@]}" --sections train --pes "${TR_PES:-nope,rope,$BIAS_PES}" --out "$DIR/tr"
}
ab_stage() {  # ab_stage ID DEFAULT_BUDGET WHAT PES BEFORE [FLAGS...]: PES alternated with BEFORE undone
    local id=$1 budget=$2 what=$3 pes=$4 before=$5 var
    shift 5
    var="$(printf '%s' "$id" | tr '[:lower:]' '[:upper:]')_BUDGET_S"
    stage "$id" "${!var:-$budget}" "$what" -- \
        "${BENCH[@]}" "${MODEL[@]}" --sections train --pes "$pes" "$@" --before "$before" --out "$DIR/$id"
}
run_fo() {
    ab_stage fo 150 "Flex offset biases: captured vector vs bias_fn per score" alibi,t5,kerple flex_offsets \
        --no-nope-reference
}
run_kc() {
    ab_stage kc 120 "ALiBi, forget-ALiBi: Flex vs key columns of fused SDPA" alibi,forget_alibi flex \
        --no-nope-reference
}
run_fd() {
    ab_stage fd 120 "Flex at lengths divisible by 128: told (IS_DIVISIBLE) vs bounds checks" alibi,t5,fire \
        flex_divisible --no-nope-reference
}
run_sh() {
    ab_stage sh 150 "Shaw, CoPE training: their own attention vs explicit softmax / masked path" shaw,cope shortcut
}
run_ev() {
    stage ev "${EV_BUDGET_S:-150}" "64k evaluation vs ALiBi" -- \
        "${BENCH[@]}" "${MODEL[@]}" --sections eval --pes "$EVAL_PES" --eval-d-model 1024 \
        --eval-lengths 16384,65536 --eval-reps 1 --out "$DIR/ev"
}
run_m1() {
    stage m1 "${M1_BUDGET_S:-90}" "MFU d1024, 4 layers" -- \
        "${BENCH[@]}" "${MFU[@]}" --mfu-d-models 1024 --n-layers 4 --out "$DIR/m1"
}
run_m2() {
    stage m2 "${M2_BUDGET_S:-120}" "MFU d2048, 8 layers (target >= 45%)" -- \
        "${BENCH[@]}" "${MFU[@]}" --mfu-d-models 2048 --n-layers 8 --out "$DIR/m2"
}
run_mc() {
    stage mc "${MC_BUDGET_S:-180}" "MFU d2048, 8 layers, torch.compile of the model" -- \
        "${BENCH[@]}" "${MFU[@]}" --mfu-d-models 2048 --n-layers 8 --compile --out "$DIR/mc"
}

for id in ${STAGES//,/ }; do "run_$id"; done

[ "$DRY_RUN" = 1 ] && exit 0
cat "$SUMMARY"
! grep -q -e '| FAILED |' -e '| TIMEOUT |' -e '| SKIPPED |' "$SUMMARY"
