#!/usr/bin/env bash
# Offline set-up of a lent GPU machine for posformer's GPU scripts (gpu_check.sh's setup stage,
# gpu_speed.sh's first step). A stock PyTorch image may lack hydra, omegaconf, x-transformers and
# datasets 5, or carry a datasets that fails to import beside an older huggingface_hub; the wheels of
# /work/shared/gpu/wheels.sh (carried to the machine as .whl/) provide them:
#   - when one of them does not import and .whl/ exists: the wheels into SITE (pip --target), which
#     then leads PYTHONPATH;
#   - posformer itself (`pip install -e .`, offline) unless it is installed;
#   - one line that imports everything the GPU scripts' stages import.
#
#   bash scripts/gpu_setup.sh [PYTHON] [SITE]   # defaults: python3, /tmp/site; exit 0 when all imports
#   source scripts/gpu_setup.sh                 # the functions below, for a script's own shell:
#   gpu_setup PYTHON SITE                       #   the same, with PYTHONPATH exported to that shell

#: what the wheels provide, and what the GPU scripts' stages import
WHEELS_IMPORT="import hydra, omegaconf, datasets, x_transformers"
STAGES_IMPORT="$WHEELS_IMPORT, lightning, posformer, posformer.data.synthetic, posformer.training"

needs_wheels() {  # needs_wheels PYTHON: whether .whl/ is here and one of the wheels' packages fails
    [ -d .whl ] && ! "$1" -c "$WHEELS_IMPORT" 2>/dev/null
}

gpu_setup() {  # gpu_setup PYTHON SITE: install what is missing, export PYTHONPATH, check the imports
    local py=$1 site=$2
    if needs_wheels "$py"; then
        echo "installing .whl/*.whl into $site"
        "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl ||
            return 1
    fi
    if [ -d "$site" ] && [ -n "$(ls -A "$site" 2>/dev/null)" ]; then
        export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    fi
    if "$py" -c 'import importlib.metadata as m; m.version("posformer")' 2>/dev/null; then
        echo "posformer is installed"
    else
        echo "pip install -e ."
        "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . ||
            "$py" -m pip install -q --no-index --no-deps --no-build-isolation --break-system-packages -e . ||
            return 1
    fi
    "$py" -c "$STAGES_IMPORT; print('imports ok: $STAGES_IMPORT')"
}

[[ "${BASH_SOURCE[0]}" == "$0" ]] || return 0   # sourced: the functions only
gpu_setup "${1:-python3}" "${2:-/tmp/site}"
