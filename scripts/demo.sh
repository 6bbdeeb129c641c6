#!/usr/bin/env bash
# Sets up the environment (scripts/setup.sh) and runs the main job: river-hf generate on the packaged model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ "$#" -eq 0 ]; then
    set -- "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"
fi
river-hf generate "$@"
