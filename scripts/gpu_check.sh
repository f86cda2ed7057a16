#!/usr/bin/env bash
# The prepared GPU check (issue #30): on ONE CUDA device, in at most ~8 minutes (global budget 470 s),
# the user flow as a new user runs it, stage by stage, each under its own time budget, ending in ONE
# table: stage | status | seconds | note. The stages:
#   setup  the wheels in .whl when hydra is missing (see /work/shared/gpu/wheels.sh: --target
#          $GPU_CHECK_SITE, then PYTHONPATH), and `pip install -e .` when posformer is not installed
#   a      every registered PE (posformer.list_encodings(), read at run time) trained A_STEPS steps
#          through ONE `posformer-train -m pe=<all> trainer=gpu` multirun with the default callbacks
#          (PE heat map, checkpoints, throughput, ...), evaluated at short lengths; the sweep summary
#   b      rope, alibi and t5 x the five precisions 32-true,16-mixed,bf16-mixed,bf16-true,16-true,
#          one multirun, a few steps each, evaluated
#   c      the encoder-decoder (model=encdec_tiny pe=t5) and its final evaluation; it once hung for
#          more than 60 s, so a hang is a TIMEOUT here, not a stuck script
#   d1     a character LM (experiment=lm_shakespeare) trained briefly on a text the script writes
#          (README.md and docs/*.md: no download, no ../shared)
#   d2     posformer-eval eval=extrapolate of d1's checkpoint, unscaled and with YaRN (factor auto)
#   e      posformer-inspect for an embedding, a rotary and a bias PE on the device (device=$DEVICE)
#   f      a 2-job sweep (-m pe=rope,alibi) and its summary.{md,png,svg} in the sweep dir
#   g      posformer-bench --quick --device cuda: every PE, every section (train, mfu, eval, gen) on
#          a tiny model, against x-transformers when it is installed
#   h      the CUDA-marked tests, trimmed (pytest -m "cuda and not slow"; -n 8 with pytest-xdist):
#          FlexAttention = SDPA = explicit softmax, forward and q/k/v gradients, for every
#          elementwise-bias PE and nope, causal and bidirectional, no / padding / document masks, fp32
#          and bf16; auto picks Flex and compiles once for many lengths. The eager-Flex warning is an
#          error there.
# After setup the stages run in three lanes at once, each lane with its own fresh data cache:
# a c e f | b d1 d2 g | h (GPU_CHECK_PARALLEL=0: one after the other, a to h). Ctrl-C / TERM stops
# the running stages (each is its own process group) and keeps the table.
# A stage FAILS when its command exits non-zero, runs past its budget (TIMEOUT), leaves an expected
# file missing, or when its output or its runs' logs show a device mismatch ("Expected all tensors to
# be on the same device"), the recompile limit (recompile_limit, cache_size_limit) or eager
# FlexAttention ("flex_attention called without torch.compile", "materializes the full scores"), exit
# status 0 or not (scripts/gpu_check_scan.py). A stage's budget is cut to what is left of the global
# budget; one that would start with less than 10 s left is SKIPPED (and counts as failed).
#
# Output, all in one folder (default outputs/gpu_check/<date-time>/, git-ignored):
#   summary.md  the table (also printed at the end; rewritten after every stage)
#   versions.txt, nvidia-smi.txt
#   logs.tar.gz every stage's log and the small result files (sweep summaries, results/extrapolation
#               tables, bench.md/json, the tests' junit XML, the runs' Hydra logs)
#   work/logs/<stage>.log, work/runs/<stage>/ (Hydra run and sweep dirs, checkpoints, bench output)
# Exit status: 0 only if every stage passed; 2 without a CUDA device (nothing run).
#
#   scripts/gpu_check.sh [DIR]                    # on the GPU machine
#   bash scripts/gpu_check.sh $OUT/gpu_check      # the device tool: only files up to 2 folders below
#                                                 # $OUT come back, so the top 4 files do, work/ does not
#   scripts/gpu_check.sh --dry-run [DIR]          # print every stage's command; runs nothing, no CUDA needed
#   GPU_CHECK_DRY_RUN=1 scripts/gpu_check.sh DIR  # the same
#   GPU_CHECK_DEVICE=cpu A_STEPS=4 ... scripts/gpu_check.sh DIR   # a CPU rehearsal of the same commands
#                                                 # (trainer=cpu, --device cpu; the CUDA tests skip)
# Env (defaults in brackets): GLOBAL_BUDGET_S [470]; per stage SETUP_BUDGET_S [90], A_BUDGET_S [150],
#   B_BUDGET_S [120], C_BUDGET_S [90], D1_BUDGET_S [75], D2_BUDGET_S [60], E_BUDGET_S [40],
#   F_BUDGET_S [60], G_BUDGET_S [120], H_BUDGET_S [180] (TEST_BUDGET_S, BENCH_BUDGET_S: the old names
#   of H and G); steps A_STEPS [200], B_STEPS [30], C_STEPS [200], D_STEPS [100], F_STEPS [100];
#   PYTHON [.venv/bin/python if present, else python3]; PYTEST_ARGS [-n 8 when pytest-xdist is
#   installed]; GPU_CHECK_PARALLEL [1]; GPU_CHECK_DEVICE [cuda]; GPU_CHECK_SITE [/tmp/site: the wheels];
#   GPU_CHECK_STAGES [all: e.g. "c,d1,d2" reruns those after setup, e.g. with a larger budget].
set -uo pipefail

# ------------------------------------------------------------------------------------ helpers
# (tests/test_gpu_check.py sources this file for them: it returns before the check starts)
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
        h) grep -o 'tests="[0-9]*"\|failures="[0-9]*"\|errors="[0-9]*"\|skipped="[0-9]*"' \
               "$RUNS/h/cuda_tests.xml" 2>/dev/null | head -n 4 | tr -d '"' | paste -sd' ' - ;;
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
GLOBAL_BUDGET_S=${GLOBAL_BUDGET_S:-470}
SETUP_BUDGET_S=${SETUP_BUDGET_S:-90}
A_BUDGET_S=${A_BUDGET_S:-150}
B_BUDGET_S=${B_BUDGET_S:-120}
C_BUDGET_S=${C_BUDGET_S:-90}
D1_BUDGET_S=${D1_BUDGET_S:-75}
D2_BUDGET_S=${D2_BUDGET_S:-60}
E_BUDGET_S=${E_BUDGET_S:-40}
F_BUDGET_S=${F_BUDGET_S:-60}
G_BUDGET_S=${G_BUDGET_S:-${BENCH_BUDGET_S:-120}}
H_BUDGET_S=${H_BUDGET_S:-${TEST_BUDGET_S:-180}}
A_STEPS=${A_STEPS:-200}
B_STEPS=${B_STEPS:-30}
C_STEPS=${C_STEPS:-200}
D_STEPS=${D_STEPS:-100}
F_STEPS=${F_STEPS:-100}
MIN_STAGE_S=10   # a stage that would get less than this is SKIPPED
PRECISIONS=32-true,16-mixed,bf16-mixed,bf16-true,16-true

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
# Installs what a stock PyTorch image lacks, offline, as /work/shared/gpu/wheels.sh's header says:
# the wheels into $SITE (then on PYTHONPATH) only when .whl exists and hydra is missing; then the
# project itself, editable, unless it is installed already.
ORDER+=(setup)
USE_SITE=0
if [ -d .whl ] && ! "$PYTHON" -c 'import hydra, omegaconf' 2>/dev/null; then USE_SITE=1; fi
SETUP='set -e
py=$1 site=$2
if [ -d .whl ] && ! "$py" -c "import hydra, omegaconf" 2>/dev/null; then
    echo "installing .whl/*.whl into $site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl
fi
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
if "$py" -c "import importlib.metadata as m; m.version(\"posformer\")" 2>/dev/null; then
    echo "posformer is installed"
else
    echo "pip install -e ."
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . ||
        "$py" -m pip install -q --no-index --no-deps --no-build-isolation --break-system-packages -e .
fi
"$py" -c "import hydra, omegaconf, lightning, posformer; print(\"imports ok\")"'
stage setup "wheels (if hydra is missing) and pip install -e ." "$SETUP_BUDGET_S" bash -c "$SETUP" setup "$PYTHON" "$SITE"
if [ "$USE_SITE" = 1 ]; then export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}; fi

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
read -r -a BENCH <<< "$(cli posformer-bench posformer.cli.bench)"
# every registered PE, read from the registry now (a PE added later is checked without editing this)
PES_ERR=$(mktemp)
ALL_PES=$("$PYTHON" -c 'import posformer; print(",".join(posformer.list_encodings()))' 2>"$PES_ERR")
N_PES=$(echo "$ALL_PES" | tr ',' '\n' | grep -c .)
if [ -z "$ALL_PES" ]; then
    echo "gpu_check.sh: cannot list the PEs: $(tail -n 1 "$PES_ERR")" >&2
    ALL_PES="<posformer.list_encodings() failed>"
fi
rm -f "$PES_ERR"
if [ -z "${PYTEST_ARGS+x}" ]; then
    if "$PYTHON" -c 'import xdist' 2>/dev/null; then PYTEST_ARGS="-n 8"; else PYTEST_ARGS=""; fi
fi
read -r -a PYTEST_EXTRA <<< "$PYTEST_ARGS"
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

# b. Five precisions x three PE kinds (rotary, parameter-free bias, learned bias).
stage_b() {
    EXPECT=("summary.md" "*/results.json#15")
    stage b "precisions x rope/alibi/t5, one multirun, ${B_STEPS} steps" "$B_BUDGET_S" \
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

# g. The benchmark's smoke test on the device: every PE and section, tiny model.
stage_g() {
    EXPECT=("bench.json" "bench.md")
    stage g "posformer-bench --quick --device $DEVICE" "$G_BUDGET_S" \
        "${BENCH[@]}" --quick --device "$DEVICE" --out "$RUNS/g"
}

# h. The trimmed CUDA tests of the whole suite (tests/test_flex.py keeps its exhaustive grid under
# `slow`); a module that fails to import is reported without stopping the others. The eager-Flex
# warning, which the suite's warning filter hides, is an error here.
stage_h() {
    [ "$DRY_RUN" = 1 ] || mkdir -p "$RUNS/h"
    EXPECT=("cuda_tests.xml")
    stage h "CUDA tests (-m 'cuda and not slow'${PYTEST_ARGS:+ $PYTEST_ARGS})" "$H_BUDGET_S" \
        "$PYTHON" -m pytest tests -m "cuda and not slow" --continue-on-collection-errors \
        -p no:cacheprovider -q -rfE --tb=short \
        -W "error:flex_attention called without torch.compile:UserWarning" \
        --junitxml "$RUNS/h/cuda_tests.xml" ${PYTEST_EXTRA[@]+"${PYTEST_EXTRA[@]}"}
}

lane() {  # lane NAME ID...: the stages one after the other, with this lane's own data cache
    local name=$1 id
    shift
    [ "$DRY_RUN" = 1 ] || export POSFORMER_CACHE=$WORK/cache/$name
    for id in "$@"; do "stage_$id"; done
}

LM_TEXT=$WORK/data/lm_text.txt
for id in a b c d1 d2 e f g h; do selected "$id" && ORDER+=("$id"); done
if [ "$PARALLEL" = 1 ] && [ "$DRY_RUN" = 0 ]; then
    # three lanes at once (the GPU and 16 cores have room; compiling is the long part): d2 needs d1
    echo "gpu_check.sh: lanes in parallel: a c e f | b d1 d2 g | h"
    lane 1 a c e f &
    pids=($!)
    lane 2 b d1 d2 g &
    pids+=($!)
    lane 3 h &
    pids+=($!)
    wait "${pids[@]}"
else
    [ "$DRY_RUN" = 0 ] || [ "$PARALLEL" != 1 ] ||
        echo "(in a real run three lanes run at once: a c e f | b d1 d2 g | h)"
    lane 1 a b c d1 d2 e f g h
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
