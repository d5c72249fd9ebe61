#!/usr/bin/env bash
# Server CPU per 503 (issue 11): a model whose queue is always full (echo, 1.5 s batches, queue
# bound 1), 16 closed-loop clients for 8 s; almost every request is refused. Prints the 503s
# answered and the server's CPU time per 503, for each source tree given (e.g. this tree and a
# copy without the early refusal), so two builds are compared in one run.
#     bash benchmarks/refusal_cost.sh src [/tmp/other/src ...]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/repo/slow/1"
cat > "$WORK/repo/slow/config.toml" <<'TOML'
platform = "echo"
max_batch_size = 1
inputs = [{name = "x", datatype = "FP32", shape = [1]}]
outputs = [{name = "x", datatype = "FP32", shape = [1]}]
[parameters]
latency_a_ms = 1500
[dynamic_batching]
default_queue_policy = {max_queue_size = 1}
TOML
echo '{"inputs":[{"name":"x","datatype":"FP32","shape":[1,1],"data":[1.5]}]}' > "$WORK/in.jsonl"
TICK_US=$((1000000 / $(getconf CLK_TCK)))
for SRC in "$@"; do
  SRC="$(cd "$SRC" && pwd)"
  PORT="$("$PY" -c 'from fulcrum.demo import free_port; print(free_port())')"
  PYTHONPATH="$SRC" "$PY" -m fulcrum.cli serve --repository "$WORK/repo" --port "$PORT" \
    > "$WORK/server.log" 2>&1 &
  PID=$!
  for _ in $(seq 60); do curl -sf "http://127.0.0.1:$PORT/v2/health/ready" >/dev/null && break; sleep 1; done
  read -r -a st < "/proc/$PID/stat"; BEFORE=$(( st[13] + st[14] ))
  "$PY" -m fulcrum.cli bench slow --url "http://127.0.0.1:$PORT" --concurrency 16 --duration 8 \
    --warmup 0 --no-progress --input-file "$WORK/in.jsonl" > "$WORK/bench.txt" 2>&1 || true
  read -r -a st < "/proc/$PID/stat"; AFTER=$(( st[13] + st[14] ))
  kill "$PID"; wait "$PID" 2>/dev/null || true
  N="$(grep -o '503:[0-9]*' "$WORK/bench.txt" | head -1 | cut -d: -f2)"
  N="${N:-0}"
  echo "$SRC: ${N} 503s in 8 s, server CPU $(( (AFTER - BEFORE) * TICK_US / 1000 )) ms, $(( N > 0 ? (AFTER - BEFORE) * TICK_US / N : 0 )) us per 503"
done
