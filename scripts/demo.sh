#!/usr/bin/env bash
# Installs dlbridge into a virtual environment and runs the main demo.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
step "running examples/demo.py"
"$PY" "$ROOT/examples/demo.py"
