#!/usr/bin/env bash
# The GPU check in two halves (bench/gpu_check.py says what each step measures):
#   bash bench/gpu_check.sh prepare      here, where pip reaches PyPI: wheels of what the GPU box lacks (DeepSpeed built
#                                        from its source distribution, datasets, lm-eval, their small dependencies) into
#                                        .gpu_wheels/ with MANIFEST.json, at most 60 MiB; its path on the last line
#   bash bench/gpu_check.sh run          there, one CUDA GPU, no network: installs the wheels into a scratch directory
#                                        on PYTHONPATH (the machine's torch untouched), then measures, in under 8
#                                        minutes, and prints one table; JSON, table and logs in $OUT (default
#                                        bench/results/gpu_check)
#   bash bench/gpu_check.sh run --cpu    the same steps at tiny size on 2 CPU processes, with this environment
# PYTHON picks the interpreter: by default the project's .venv (make) where there is one, else python3 (on the GPU box,
# the one that holds its torch).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
fi
case "${1:-}" in
    prepare) shift; exec "$PYTHON" bench/gpu_wheels.py "$@" ;;
    run) shift; exec "$PYTHON" bench/gpu_check.py "$@" ;;
    *) echo "error: '${1:-}' is not a step of the GPU check: say prepare (here, with PyPI), then run (on the" \
            "GPU machine), or run --cpu" >&2
       exit 2 ;;
esac
