#!/usr/bin/env bash
# The prepared GPU check: on ONE CUDA device, on a COLD machine (a fresh lease: nothing compiled yet),
# the user flow as a new user runs it, stage by stage, each under its own time budget, within a global
# budget of 540 s, ending in ONE table: stage | status | seconds | note. Compiling is most of the time
# on a cold machine, so the stages that matter most start first, each in its own lane, and every
# budget is sized by the budget model (scripts/gpu_budget.py: the distinct compiled graphs of each
# stage, counted on the CPU, times a stated cost per graph; tests/project/test_gpu_check.py fails when an
# estimate exceeds its budget). The stages:
#   setup  the wheels in .whl when hydra, omegaconf, datasets or x-transformers do not import (see
#          /work/shared/gpu/wheels.sh: --target $GPU_CHECK_SITE, then PYTHONPATH), `pip install -e .`
#          when posformer is not installed; then everything a stage imports, in one line
#   a      every registered PE (posformer.list_encodings(), read at run time) trained A_STEPS steps
#          through ONE `posformer-train -m pe=<all> trainer=gpu` multirun (bf16-mixed) with the default
#          callbacks, evaluated at short lengths; the sweep summary
#   c      the encoder-decoder (model=encdec_tiny pe=t5) and its final evaluation (its block masks once
#          overran torch's own graph limit; a hang is a TIMEOUT here)
#   h      about twenty CUDA test cases (scripts/gpu_check_cases.txt) that touch every CUDA path once,
#          one pytest process per module (scripts/gpu_check_tests.py): `-v` and a junit file per module,
#          so a timeout keeps what passed. The eager-Flex warning is an error there.
#   b      rope, alibi and t5 x three precisions (32-true, 16-mixed, bf16-true: stage a runs bf16-mixed),
#          one multirun, a few steps each, evaluated
#   d1     a character LM (experiment=lm_shakespeare) trained briefly on a text the script writes
#          (README.md and docs/*.md: no download, no ../shared)
#   d2     posformer-eval eval=extrapolate of d1's checkpoint, unscaled and with YaRN (factor auto)
#   e      posformer-inspect for an embedding, a rotary and a bias PE on the device (device=$DEVICE)
#   f      a 2-job sweep (-m pe=rope,alibi) and its summary.{md,png,svg} in the sweep dir
# (The benchmark's smoke test, posformer-bench --quick, is scripts/gpu_speed.sh's stage q.)
# After setup the stages run in four lanes at once, each with its own data cache and its share of the
# cores for inductor's compile workers (TORCHINDUCTOR_COMPILE_THREADS = cores / 4):
# a | c e f | h | b d1 d2 (GPU_CHECK_PARALLEL=0: one after the other). The dry run prints the
# timeline. Ctrl-C / TERM stops the running stages (each is its own process group) and keeps the table.
# A stage FAILS when its command exits non-zero, runs past its budget (TIMEOUT), leaves an expected
# file missing, or when its output or its runs' logs show a device mismatch ("Expected all tensors to
# be on the same device"), posformer's own graph limit (FlexRecompileError), a FlexAttention failure
# that a run survived on another path ("FlexAttention failed in the"), or eager FlexAttention
# ("flex_attention called without torch.compile", "materializes the full scores"), exit status 0 or
# not (scripts/gpu_check_scan.py). A stage's budget is cut to what is left of the global budget; one
# that would start with less than 10 s left is SKIPPED (and counts as failed).
#
# Output, all in one folder (default outputs/gpu_check/<date-time>/, git-ignored):
#   summary.md  the table (also printed at the end; rewritten after every stage)
#   versions.txt, nvidia-smi.txt
#   logs.tar.gz every stage's log and the small result files (sweep summaries, results/extrapolation
#               tables, the tests' junit XML and logs, the runs' Hydra logs)
#   work/logs/<stage>.log, work/runs/<stage>/ (Hydra run and sweep dirs, checkpoints, test reports)
# Exit status: 0 only if every stage passed; 2 without a CUDA device (nothing run).
#
#   scripts/gpu_check.sh [DIR]                    # on the GPU machine
#   bash scripts/gpu_check.sh $OUT/gpu_check      # the device tool: only files up to 2 folders below
#                                                 # $OUT come back, so the top 4 files do, work/ does not
#   scripts/gpu_check.sh --dry-run [DIR]          # every stage's command and the timeline; runs nothing
#   GPU_CHECK_DRY_RUN=1 scripts/gpu_check.sh DIR  # the same
#   GPU_CHECK_DEVICE=cpu A_STEPS=4 ... scripts/gpu_check.sh DIR   # a CPU rehearsal of the same commands
#                                                 # (trainer=cpu, device=cpu; the CUDA tests skip)
# Env (defaults in brackets): GLOBAL_BUDGET_S [540]; per stage SETUP_BUDGET_S [90], A_BUDGET_S [420],
#   C_BUDGET_S [240], E_BUDGET_S [60], F_BUDGET_S [130], H_BUDGET_S [420], B_BUDGET_S [270],
#   D1_BUDGET_S [60], D2_BUDGET_S [60]; steps A_STEPS [100], B_STEPS [20], C_STEPS [100], D_STEPS [100],
#   F_STEPS [50]; PYTHON [.venv/bin/python if present, else python3]; GPU_CHECK_PARALLEL [1];
#   GPU_CHECK_DEVICE [cuda]; GPU_CHECK_SITE [/tmp/site: the wheels]; GPU_CHECK_STAGES [all: e.g.
#   "c,d1,d2" reruns those after setup, e.g. with a larger budget]; GPU_CHECK_CASES
#   [scripts/gpu_check_cases.txt]; GPU_CHECK_CORES [nproc; a dry run: 16, the GPU machines'];
#   COMPILE_THREADS [cores / 4: per lane].
set -uo pipefail

# ------------------------------------------------------------------------------------ helpers
# (tests/project/test_gpu_check.py sources this file for them: it returns before the check starts)
SAFE_RE='^[A-Za-z0-9_./=:,+@%-]+$'
quote() {  # the arguments as one line that a shell reads back as the same words
    local out="" a q="'"
    for a in "$@"; do
        if [[ $a =~ $SAFE_RE ]]; then out+="$a "; else out+="'${a//$q/$q\\$q$q}' "; fi
    done
    printf '%s\n' "${out% }"
}

HYDRA_SAFE_RE='^[A-Za-z0-9_./-]+$'
hv() {  # a path as a Hydra override value: quoted if it holds more than [A-Za-z0-9_./-] (',' is grammar)
    if [[ $1 =~ $HYDRA_SAFE_RE ]]; then printf '%s' "$1"; else printf "'%s'" "$1"; fi
}

cli() {  # cli NAME MODULE: the console script NAME of $PYTHON's installation, else "$PYTHON -m MODULE"
    local name=$1 module=$2 dir
    for dir in "$(dirname "$(command -v "$PYTHON" || echo "$PYTHON")")" \
        "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null)"; do
        if [ -n "$dir" ] && [ -x "$dir/$name" ]; then echo "$dir/$name"; return; fi
    done
    if command -v "$name" >/dev/null 2>&1; then command -v "$name"; else echo "$PYTHON -m $module"; fi
}

ORDER=()   # stage ids in table order
record() {  # record ID TITLE STATUS SECONDS NOTE: one row of the table (a file: background stages too)
    printf '%s\t%s\t%s\t%s\n' "$2" "$3" "$4" "$5" > "$STATUS/$1.tsv"
}

write_summary() {  # summary.md from the recorded rows, in ORDER
    local id title st secs note
    {
        echo "# GPU check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo
        [ -s "$DIR/versions.txt" ] && sed 's/^/    /' "$DIR/versions.txt" && echo
        echo "| stage | status | seconds | note |"
        echo "|---|---|---:|---|"
        for id in "${ORDER[@]}"; do
            if [ -f "$STATUS/$id.tsv" ]; then
                IFS=$'\t' read -r title st secs note < "$STATUS/$id.tsv"
            else
                title="" st="not started" secs="" note=""
            fi
            echo "| $id $title | $st | $secs | ${note//|//} |"
        done
        echo
        echo "Logs: $LOGS/<stage>.log (and in logs.tar.gz); runs: $RUNS/<stage>/."
    } > "$SUMMARY.$BASHPID" && mv "$SUMMARY.$BASHPID" "$SUMMARY"
}

selected() {  # selected ID: whether GPU_CHECK_STAGES (a comma list; empty: every stage) names ID
    [ -z "${GPU_CHECK_STAGES:-}" ] || [ "$1" = setup ] || [[ ",$GPU_CHECK_STAGES," == *",$1,"* ]]
}

EXPECT=()   # files (globs under the stage's run dir; GLOB#N: at least N) a stage must leave; reset by stage
# stage ID TITLE BUDGET CMD...: run CMD under `timeout` (the smaller of BUDGET and what is left of the
# global budget), its output into logs/ID.log, then judge it (exit status, budget, failure patterns in
# the log and in runs/ID/, expected files) and record one row of the table.
stage() {
    local id=$1 title=$2 budget=$3
    shift 3
    local expect=(${EXPECT[@]+"${EXPECT[@]}"})
    EXPECT=()
    selected "$id" || return 0
    if [ "$DRY_RUN" = 1 ]; then
        echo "== $id ($budget s): $title"
        echo "   \$ $(quote "$@")"
        [ ${#expect[@]} -eq 0 ] || echo "   expects: ${expect[*]} (in runs/$id)"
        return 0
    fi
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt "$MIN_STAGE_S" ]; then
        record "$id" "$title" SKIPPED 0 "global budget (GLOBAL_BUDGET_S=$GLOBAL_BUDGET_S) spent"
        echo "== $id: SKIPPED, ${left}s of the global budget left"
        write_summary
        return 0
    fi
    [ "$budget" -le "$left" ] || budget=$left
    local log=$LOGS/$id.log start=$SECONDS rc verdict="passed" note="" hits missing="" want glob n count
    echo "== $id: $title (budget ${budget}s; log work/logs/$id.log)"
    record "$id" "$title" running "" "started $(date -u +%H:%M:%S) UTC"
    write_summary
    # timeout leads its own process group (it kills the whole group at the budget); its pid file lets
    # an interrupted check (Ctrl-C, TERM) stop the stages still running (on_interrupt)
    timeout --kill-after=5 "$budget" "$@" > "$log" 2>&1 < /dev/null &
    local pid=$!
    echo "$pid" > "$STATUS/$id.pid"
    wait "$pid"
    rc=$?
    rm -f "$STATUS/$id.pid"
    local took=$((SECONDS - start))
    hits=$("$PYTHON" "$ROOT/scripts/gpu_check_scan.py" "$log" "$RUNS/$id" 2>&1)
    for want in ${expect[@]+"${expect[@]}"}; do
        glob=${want%%#*}
        n=1
        [ "$glob" = "$want" ] || n=${want##*#}
        count=$(compgen -G "$RUNS/$id/$glob" | wc -l)
        [ "$count" -ge "$n" ] || missing+="${missing:+, }$glob ($count of $n)"
    done
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        verdict=TIMEOUT note="killed after its budget of ${budget}s"
    elif [ $rc -ne 0 ]; then
        verdict=FAILED note="exit $rc"
    fi
    if [ -n "$hits" ]; then
        [ "$verdict" = TIMEOUT ] || verdict=FAILED
        note+="${note:+; }$(echo "$hits" | cut -d: -f1 | sort -u | paste -sd, -) in the logs"
    fi
    if [ -n "$missing" ]; then
        [ "$verdict" = TIMEOUT ] || verdict=FAILED
        note+="${note:+; }missing $missing"
    fi
    [ "$verdict" != passed ] || note=$(stage_note "$id")
    record "$id" "$title" "$verdict" "$took" "$note"
    local report="== $id: $verdict in ${took}s${note:+ ($note)}"
    if [ "$verdict" != passed ]; then  # one write, so that lanes running at once do not interleave it
        [ -z "$hits" ] || report+=$'\n'$(echo "$hits" | head -n 6 | sed 's/^/   | /')
        report+=$'\n'$(tail -n 15 "$log" | cut -c1-300 | sed 's/^/   | /')
    fi
    printf '%s\n' "$report"
    write_summary
}

stage_note() {  # a short fact about a passed stage for the table
    case $1 in
        a|b|f) echo "$(compgen -G "$RUNS/$1/*/results.json" | wc -l) jobs with results.json" ;;
        h) grep '^tests=' "$LOGS/h.log" 2>/dev/null | tail -n 1 | cut -d';' -f1 ;;
        *) echo "" ;;
    esac
}

on_interrupt() {  # Ctrl-C or TERM: stop every running stage (its timeout's process group), keep the table
    trap - INT TERM
    local f
    for f in "$STATUS"/*.pid; do
        [ -f "$f" ] || continue
        kill -TERM -- "-$(cat "$f")" 2>/dev/null
        sed -i 's/\trunning\t/\tINTERRUPTED\t/' "${f%.pid}.tsv"
    done
    kill $(jobs -p) 2>/dev/null
    write_summary
    echo "gpu_check.sh: interrupted; $SUMMARY" >&2
    exit 130
}

set_dirs() {  # set_dirs DIR: the output folder (absolute) and the paths under it
    DIR=$1
    WORK=$DIR/work
    LOGS=$WORK/logs
    RUNS=$WORK/runs
    STATUS=$WORK/status
    SUMMARY=$DIR/summary.md
}

[[ "${BASH_SOURCE[0]}" == "$0" ]] || return 0   # sourced: the functions only

# The check is one function, parsed whole before it starts: editing this file during a run cannot
# change what the run does.
main() {
ROOT=$(cd "$(dirname "$0")/.." && pwd) || exit 2

# ------------------------------------------------------------------------------------ arguments, settings
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
DIR=""
for arg in "$@"; do
    case $arg in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu_check.sh: unknown option $arg (--dry-run, --help)" >&2; exit 2 ;;
        *) [ -z "$DIR" ] || { echo "gpu_check.sh: one output folder only" >&2; exit 2; }; DIR=$arg ;;
    esac
done
[ "$DRY_RUN" = 0 ] || DRY_RUN=1
DIR=$(realpath -m "${DIR:-$ROOT/outputs/gpu_check/$(date +%Y%m%d-%H%M%S)}")   # relative: to the caller's folder
cd "$ROOT" || exit 2

DEVICE=${GPU_CHECK_DEVICE:-cuda}
case $DEVICE in
    cuda) TRAINER=gpu ;;
    cpu) TRAINER=cpu ;;
    *) echo "gpu_check.sh: GPU_CHECK_DEVICE=$DEVICE must be cuda or cpu" >&2; exit 2 ;;
esac
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
PARALLEL=${GPU_CHECK_PARALLEL:-1}
SITE=${GPU_CHECK_SITE:-/tmp/site}
GLOBAL_BUDGET_S=${GLOBAL_BUDGET_S:-540}
SETUP_BUDGET_S=${SETUP_BUDGET_S:-90}
A_BUDGET_S=${A_BUDGET_S:-420}
C_BUDGET_S=${C_BUDGET_S:-240}
E_BUDGET_S=${E_BUDGET_S:-60}
F_BUDGET_S=${F_BUDGET_S:-130}
H_BUDGET_S=${H_BUDGET_S:-420}
B_BUDGET_S=${B_BUDGET_S:-270}
D1_BUDGET_S=${D1_BUDGET_S:-60}
D2_BUDGET_S=${D2_BUDGET_S:-60}
A_STEPS=${A_STEPS:-100}
B_STEPS=${B_STEPS:-20}
C_STEPS=${C_STEPS:-100}
D_STEPS=${D_STEPS:-100}
F_STEPS=${F_STEPS:-50}
MIN_STAGE_S=10   # a stage that would get less than this is SKIPPED
PRECISIONS=32-true,16-mixed,bf16-true   # stage a runs trainer=gpu's bf16-mixed
CASES=${GPU_CHECK_CASES:-scripts/gpu_check_cases.txt}
# cores: this machine's; a dry run plans for the lent GPU machines' 16 (GPU_CHECK_CORES)
if [ "$DRY_RUN" = 1 ]; then CORES=${GPU_CHECK_CORES:-16}; else CORES=${GPU_CHECK_CORES:-$(nproc 2>/dev/null || echo 4)}; fi
COMPILE_THREADS=${COMPILE_THREADS:-$(( CORES / 4 > 0 ? CORES / 4 : 1 ))}
# the lanes after setup, each a list of stages run one after the other (d2 needs d1)
LANES=("a" "c e f" "h" "b d1 d2")

if [ "$DRY_RUN" = 0 ]; then
    mkdir -p "$DIR" || { echo "gpu_check.sh: cannot create the output folder $DIR" >&2; exit 2; }
fi
set_dirs "$DIR"
[ "$DRY_RUN" = 1 ] || trap on_interrupt INT TERM
DEADLINE=$((SECONDS + GLOBAL_BUDGET_S))

# ------------------------------------------------------------------------------------ device, versions
if [ "$DRY_RUN" = 0 ] && [ "$DEVICE" = cuda ] &&
    ! timeout 120 "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check.sh: no CUDA device is visible to $PYTHON (torch.cuda.is_available() is False);" \
        "run it on a machine with one NVIDIA GPU and a CUDA build of torch (or --dry-run)." >&2
    exit 2
fi
if [ "$DRY_RUN" = 0 ]; then
    rm -rf "$STATUS"
    mkdir -p "$LOGS" "$RUNS" "$STATUS" || exit 2
    echo "gpu_check.sh: writing to $DIR (device $DEVICE, global budget ${GLOBAL_BUDGET_S}s)"
else
    echo "gpu_check.sh --dry-run: the stages, their budgets (s) and commands; nothing is run" \
        "(device $DEVICE, global budget ${GLOBAL_BUDGET_S}s, output $DIR)"
fi

# ------------------------------------------------------------------------------------ setup
# Installs what a stock PyTorch image lacks, offline (scripts/gpu_setup.sh): the wheels into $SITE (then
# on PYTHONPATH) when one of hydra, omegaconf, datasets, x-transformers does not import; posformer
# itself unless it is installed; then one line importing everything the stages import.
ORDER+=(setup)
stage setup "wheels (if an import fails), pip install -e ., every stage's imports" "$SETUP_BUDGET_S" \
    bash scripts/gpu_setup.sh "$PYTHON" "$SITE"
if [ -n "$(ls -A "$SITE" 2>/dev/null)" ]; then export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}; fi

if [ "$DRY_RUN" = 0 ]; then
    timeout 60 "$PYTHON" - > "$DIR/versions.txt" 2>&1 <<'EOF'
import importlib.metadata as m
import platform

import torch

print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "| capability", torch.cuda.get_device_capability(0))
names = ("posformer", "lightning", "hydra-core", "omegaconf", "triton", "x-transformers", "pytest", "pytest-xdist")
found = []
for name in names:
    try:
        found.append(f"{name} {m.version(name)}")
    except m.PackageNotFoundError:
        found.append(f"{name} -")
print(" | ".join(found))
EOF
    if command -v nvidia-smi > /dev/null; then timeout 30 nvidia-smi > "$DIR/nvidia-smi.txt" 2>&1
    else echo "nvidia-smi: not found" > "$DIR/nvidia-smi.txt"; fi
    cat "$DIR/versions.txt"
fi

read -r -a TRAIN <<< "$(cli posformer-train posformer.cli.train)"
read -r -a EVAL <<< "$(cli posformer-eval posformer.cli.evaluate)"
read -r -a INSPECT <<< "$(cli posformer-inspect posformer.cli.inspect)"
# every registered PE, read from the registry now (a PE added later is checked without editing this)
PES_ERR=$(mktemp)
ALL_PES=$("$PYTHON" -c 'import posformer; print(",".join(posformer.list_encodings()))' 2>"$PES_ERR")
N_PES=$(echo "$ALL_PES" | tr ',' '\n' | grep -c .)
if [ -z "$ALL_PES" ]; then
    echo "gpu_check.sh: cannot list the PEs: $(tail -n 1 "$PES_ERR")" >&2
    ALL_PES="<posformer.list_encodings() failed>"
fi
rm -f "$PES_ERR"
# the synthetic task, evaluated at short lengths with few examples (the default is 9 lengths x 256)
SHORT_EVAL=("data.eval_lengths=[8,16]" "data.n_eval_per_length=64" "data.n_val=128")
half() { echo $(( $1 / 2 > 0 ? $1 / 2 : 1 )); }

# ------------------------------------------------------------------------------------ the stages
# One function per stage: its expected files (EXPECT, globs under runs/ID) and its command.

# a. Every registered PE, one multirun, default callbacks (heat map on), evaluated after training.
stage_a() {
    EXPECT=("summary.md" "*/results.json#$N_PES")
    stage a "every PE ($N_PES), one multirun, ${A_STEPS} steps" "$A_BUDGET_S" \
        "${TRAIN[@]}" -m "pe=$ALL_PES" "trainer=$TRAINER" "trainer.max_steps=$A_STEPS" \
        "trainer.val_check_interval=$(half "$A_STEPS")" evaluate=true "${SHORT_EVAL[@]}" \
        "hydra.sweep.dir=$(hv "$RUNS/a")"
}

# b. Three precisions (stage a has trainer=gpu's bf16-mixed) x three PE kinds (rotary, parameter-free
# bias, learned bias).
stage_b() {
    EXPECT=("summary.md" "*/results.json#9")
    stage b "precisions ($PRECISIONS) x rope/alibi/t5, one multirun, ${B_STEPS} steps" "$B_BUDGET_S" \
        "${TRAIN[@]}" -m pe=rope,alibi,t5 "trainer.precision=$PRECISIONS" "trainer=$TRAINER" \
        "trainer.max_steps=$B_STEPS" "trainer.val_check_interval=$B_STEPS" evaluate=true \
        "${SHORT_EVAL[@]}" "hydra.sweep.dir=$(hv "$RUNS/b")"
}

# c. The encoder-decoder with its final evaluation (the default evaluation lengths).
stage_c() {
    EXPECT=("results.json" "checkpoints/last.ckpt")
    stage c "encoder-decoder t5 + final evaluation, ${C_STEPS} steps" "$C_BUDGET_S" \
        "${TRAIN[@]}" model=encdec_tiny pe=t5 "trainer=$TRAINER" "trainer.max_steps=$C_STEPS" \
        "trainer.val_check_interval=$(half "$C_STEPS")" "hydra.run.dir=$(hv "$RUNS/c")"
}

# d. A text LM on the repository's own docs (d1), then its extrapolation with and without YaRN (d2).
stage_d1() {
    if [ "$DRY_RUN" = 0 ] && selected d1; then
        mkdir -p "$(dirname "$LM_TEXT")" && cat README.md docs/*.md > "$LM_TEXT"
    fi
    EXPECT=("results.json" "checkpoints/last.ckpt")
    stage d1 "text LM (experiment=lm_shakespeare, the docs as text), ${D_STEPS} steps" "$D1_BUDGET_S" \
        "${TRAIN[@]}" experiment=lm_shakespeare "data.path=$(hv "$LM_TEXT")" "trainer=$TRAINER" \
        "trainer.max_steps=$D_STEPS" "trainer.val_check_interval=$D_STEPS" schedule.warmup_steps=0.1 \
        "data.eval_lengths=[64,256,512]" data.eval_tokens=4096 data.val_tokens=4096 \
        "hydra.run.dir=$(hv "$RUNS/d1")"
}
stage_d2() {
    EXPECT=("extrapolation.md" "extrapolation.json")
    stage d2 "posformer-eval extrapolate, rope_scaling [null, yarn auto]" "$D2_BUDGET_S" \
        "${EVAL[@]}" eval=extrapolate "eval.checkpoints=[$(hv "$RUNS/d1/checkpoints/last.ckpt")]" \
        "eval.rope_scaling=[null,{type: yarn, factor: auto}]" "trainer=$TRAINER" \
        "eval.lengths=[256,512,1024]" eval.n_tokens=4096 "hydra.run.dir=$(hv "$RUNS/d2")"
}

# e. Inspection of an embedding, a rotary and a bias PE (every section: cosines, wavelengths, logits).
stage_e() {
    EXPECT=("*/inspect.json#3")
    stage e "posformer-inspect sinusoidal, rope, t5 on $DEVICE" "$E_BUDGET_S" \
        "${INSPECT[@]}" -m pe=sinusoidal,rope,t5 model.d_model=128 max_len=128 "device=$DEVICE" \
        "hydra.sweep.dir=$(hv "$RUNS/e")"
}

# f. A 2-job sweep as the README shows it, and the summary it writes when it ends.
stage_f() {
    EXPECT=("summary.md" "summary.png" "summary.svg" "*/results.json#2")
    stage f "2-job sweep (rope, alibi) + summary.{md,png,svg}, ${F_STEPS} steps" "$F_BUDGET_S" \
        "${TRAIN[@]}" -m pe=rope,alibi "trainer=$TRAINER" "trainer.max_steps=$F_STEPS" \
        "trainer.val_check_interval=$F_STEPS" "${SHORT_EVAL[@]}" "hydra.sweep.dir=$(hv "$RUNS/f")"
}

# h. About twenty CUDA test cases, one pytest process per module (COMPILE_THREADS at once, one compile
# thread each): -v lines and a junit file per module, kept if the stage is killed at its budget. The
# eager-Flex warning, which the suite's warning filter hides, is an error here.
stage_h() {
    [ "$DRY_RUN" = 1 ] || mkdir -p "$RUNS/h"
    EXPECT=("*.xml")
    stage h "CUDA test cases ($CASES), $COMPILE_THREADS modules at once" "$H_BUDGET_S" \
        "$PYTHON" scripts/gpu_check_tests.py "$RUNS/h" --cases "$CASES" --jobs "$COMPILE_THREADS" -- \
        -W "error:flex_attention called without torch.compile:UserWarning"
}

lane() {  # lane NAME ID...: the stages one after the other, with this lane's own data cache and cores
    local name=$1 id
    shift
    if [ "$DRY_RUN" = 0 ]; then
        export POSFORMER_CACHE=$WORK/cache/$name TORCHINDUCTOR_COMPILE_THREADS=$COMPILE_THREADS
    fi
    for id in "$@"; do "stage_$id"; done
}

timeline() {  # the plan: each lane's stages with their budgets, from the end of setup
    local n=0 ids id at var
    echo "timeline (s from the start; setup 0-$SETUP_BUDGET_S, then the lanes at once; global $GLOBAL_BUDGET_S):"
    for ids in "${LANES[@]}"; do
        n=$((n + 1)) at=$SETUP_BUDGET_S
        local parts=()
        for id in $ids; do
            var="$(printf '%s' "$id" | tr '[:lower:]' '[:upper:]')_BUDGET_S"
            parts+=("$id $at-$((at + ${!var}))")
            at=$((at + ${!var}))
        done
        local joined
        joined=$(printf '%s, ' "${parts[@]}")
        echo "lane $n: ${joined%, }"
    done
}

LM_TEXT=$WORK/data/lm_text.txt
for ids in "${LANES[@]}"; do for id in $ids; do selected "$id" && ORDER+=("$id"); done; done
[ "$DRY_RUN" = 0 ] || timeline
if [ "$PARALLEL" = 1 ] && [ "$DRY_RUN" = 0 ]; then
    echo "gpu_check.sh: $COMPILE_THREADS compile threads per lane; $(timeline | tail -n +2 | paste -sd'|' -)"
    pids=()
    n=0
    for ids in "${LANES[@]}"; do
        n=$((n + 1))
        # shellcheck disable=SC2086  # a lane's stage ids are words
        lane "$n" $ids &
        pids+=($!)
    done
    wait "${pids[@]}"
else
    # shellcheck disable=SC2086
    lane 1 ${LANES[*]}
fi
[ "$DRY_RUN" = 0 ] || exit 0

write_summary
failed=0
for id in "${ORDER[@]}"; do
    [ "$(cut -f2 "$STATUS/$id.tsv" 2>/dev/null)" = passed ] || failed=$((failed + 1))
done
(cd "$DIR" && find work \( -path work/cache -o -path work/data \) -prune -o -type f \( -name '*.log' \
    -o -name '*.md' -o -name '*.json' -o -name '*.xml' -o -name '*.txt' -o -name '*.csv' \) -size -4M \
    -print0 | tar -czf logs.tar.gz --null -T -) ||
    echo "gpu_check.sh: could not write logs.tar.gz" >&2
echo
sed -n '/^| stage/,$p' "$SUMMARY"
echo "gpu_check.sh: $failed of ${#ORDER[@]} stages did not pass; $SUMMARY, $DIR/logs.tar.gz"
[ "$failed" -eq 0 ]
}

main "$@"; exit $?   # one line: read whole before main runs
