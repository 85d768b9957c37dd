#!/usr/bin/env bash
# The GPU check of issue 40: one table of the issue's targets beside the measured figures
# (benchmarks/gpu_check.py does the work; its docstring says what each step runs).
#   source .gpu/setup.sh && bash benchmarks/gpu_check.sh   # a GPU machine: ~8 minutes, Ray's starts included
#   bash benchmarks/gpu_check.sh --device cpu              # the CPU smoke: tiny sizes, seconds
# Outputs: ${OUT:-benchmarks/out/gpu_check} (the table, the raw JSON, the logs); --out DIR instead.
# Python: $PYTHON, else the project's .venv if there is one, else python3 (the GPU machine's).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
# raysim.methods is methods/ mapped by pyproject: importing raysim from the checkout finds raysim/
# but not methods/, so a machine where raysim was never installed (.gpu/setup.sh skips the install
# when `import raysim` works from the project root) installs it here, editable and offline
if ! "$py" -c "import raysim.methods" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 2
fi
exec "$py" benchmarks/gpu_check.py "$@"
