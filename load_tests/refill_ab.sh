#!/usr/bin/env bash
# The refill test (load_tests/refill.py) against the shipped serve_config.yaml, alternating the
# default admission window with admission_window_max=0 (the window off: what the window changes),
# ROUNDS times each, one server at a time on PORT. Output: one JSON line per run.
#   bash load_tests/refill_ab.sh [PORT] [ROUNDS] [CLIENTS] [SECONDS]
set -euo pipefail
PORT=${1:-48821}; ROUNDS=${2:-2}; CLIENTS=${3:-128}; SECONDS_=${4:-40}
DIR=$(mktemp -d)
pid=""
trap 'if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; fi' EXIT  # never leave a server behind
sed "s/port: 8000/port: $PORT/" serve_config.yaml > "$DIR/serve_config.yaml"
export RAY_AUTH_MODE=disabled LORA_CLUSTER_DEMO_DIR=${LORA_CLUSTER_DEMO_DIR:-$DIR/demo-zoo}
for round in $(seq "$ROUNDS"); do
  for window in default 0; do
    if [ "$window" = default ]; then unset LORA_CLUSTER_ADMISSION_WINDOW_MAX; label="defaults";
    else export LORA_CLUSTER_ADMISSION_WINDOW_MAX=0; label="admission_window_max=0 (window off, for comparison)"; fi
    .venv/bin/serve run "$DIR/serve_config.yaml" > "$DIR/serve_${round}_${window}.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do
      curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null 2>&1 && break; sleep 1
    done
    .venv/bin/python -m load_tests.refill --url "http://127.0.0.1:$PORT" --clients "$CLIENTS" \
      --seconds "$SECONDS_" --label "round $round: $label"
    kill -TERM "$pid"; wait "$pid" || true  # serve run stops the Ray instance it started
  done
done
