#!/usr/bin/env bash
# The same load against kvevict-llama serve and llama-server, side by side, on one GGUF at equal
# KV memory (docs/serving.md, "Load"). Loopback only; each server is stopped after its run.
#
#   bench/serve_compare.sh LLAMA_SERVER [MODEL.gguf]
#
# LLAMA_SERVER: a llama-server built from the same llama.cpp tree (bench/build_llama_server.sh).
# MODEL: default build/serve-load.gguf, written by serve_load_model (a random Llama with a
# byte-fallback SentencePiece vocabulary both servers read). Environment (defaults):
#   CLIENTS=8 TURNS=6 FIRST=200 TURN=60 MAX=64   the load (serve_load's options)
#   CELLS=2048        KV cells of both servers (llama-server -c; kvevict -c and --kv-pool)
#   PARALLEL=8        slots of both
#   POLICY=streaming_llm BUDGET=192   kvevict's per-request policy (budget + chunk = CELLS/PARALLEL)
#   CHUNK=64 THREADS=1 PORT=18480 BIN=build/release/bin
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
llama_server=${1:?usage: bench/serve_compare.sh LLAMA_SERVER [MODEL.gguf]}
BIN=${BIN:-build/release/bin}
model=${2:-build/serve-load.gguf}
CLIENTS=${CLIENTS:-8} TURNS=${TURNS:-6} FIRST=${FIRST:-200} TURN=${TURN:-60} MAX=${MAX:-64}
CELLS=${CELLS:-2048} PARALLEL=${PARALLEL:-8} POLICY=${POLICY:-streaming_llm} BUDGET=${BUDGET:-192}
CHUNK=${CHUNK:-64} THREADS=${THREADS:-1} PORT=${PORT:-18480}
[[ -f ${model} ]] || "${BIN}/serve_load_model" "${model}"
load=("${BIN}/serve_load" --port "${PORT}" --clients "${CLIENTS}" --turns "${TURNS}"
  --first-tokens "${FIRST}" --turn-tokens "${TURN}" --max-tokens "${MAX}" --min-id 3 --vocab 259)

wait_ready() {
  for _ in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:${PORT}/health" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  echo "serve_compare: the server did not become ready" >&2
  return 1
}
stop() {
  kill -TERM "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

echo "load: ${CLIENTS} conversations x ${TURNS} turns (${FIRST} + ${TURN}/turn prompt tokens, ${MAX} generated/turn); ${CELLS} KV cells (f16), ${PARALLEL} slots, -t ${THREADS}"

"${BIN}/kvevict-llama" serve "${model}" --port "${PORT}" --np "${PARALLEL}" -c "${CELLS}" \
  --kv-pool "${CELLS}" --kv-type f16 --chunk "${CHUNK}" -t "${THREADS}" --queue "${CLIENTS}" \
  --policy "${POLICY}" --budget "${BUDGET}" >/dev/null 2>&1 &
kvevict=$!
wait_ready
echo -n "kvevict-llama serve (${POLICY} ${BUDGET}, pool ${CELLS}): "
"${load[@]}" --kv-policy "${POLICY}" --kv-budget "${BUDGET}" --server-pid "${kvevict}" || true
stop "${kvevict}"

"${llama_server}" -m "${model}" --host 127.0.0.1 --port "${PORT}" -np "${PARALLEL}" \
  -c "${CELLS}" -t "${THREADS}" -tb "${THREADS}" --context-shift >/dev/null 2>&1 &
llama=$!
wait_ready
echo -n "llama-server (context shift, -c ${CELLS}): "
"${load[@]}" --protocol llama-server --server-pid "${llama}" || true
stop "${llama}"
