#!/usr/bin/env bash
# The same load against kvevict-llama serve and llama-server, side by side, on one GGUF at equal
# KV memory (docs/serving.md, "Load"). Loopback only; each server is stopped after its run.
#
#   bench/serve_compare.sh LLAMA_SERVER [MODEL.gguf]
#
# LLAMA_SERVER: a llama-server built from the same llama.cpp tree (bench/build_llama_server.sh).
# MODEL: default build/serve-toy.gguf, written by serve_load_model from models/toy-base (its
# vocabulary as a byte-fallback SentencePiece one both servers read). Environment (defaults):
#   CLIENTS=8 TURNS=6 FIRST=200 TURN=60 MAX=64   the load (serve_load's options)
#   CELLS=2048        KV cells of both servers (llama-server -c; kvevict -c)
#   POOL=$CELLS       kvevict's --kv-pool (0: none, each slot CELLS/PARALLEL as llama-server's)
#   PARALLEL=8        slots of both
#   POLICY=streaming_llm BUDGET=192   kvevict's per-request policy (BUDGET= for none: full)
#   CHUNK=64 THREADS=1 PORT=18480 BIN=build/release/bin
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
llama_server=${1:?usage: bench/serve_compare.sh LLAMA_SERVER [MODEL.gguf]}
BIN=${BIN:-build/release/bin}
model=${2:-build/serve-toy.gguf}
CLIENTS=${CLIENTS:-8} TURNS=${TURNS:-6} FIRST=${FIRST:-200} TURN=${TURN:-60} MAX=${MAX:-64}
CELLS=${CELLS:-2048} POOL=${POOL:-${CELLS}} PARALLEL=${PARALLEL:-8} POLICY=${POLICY:-streaming_llm} BUDGET=${BUDGET-192}
CHUNK=${CHUNK:-64} THREADS=${THREADS:-1} PORT=${PORT:-18480}
[[ -f ${model} ]] || "${BIN}/serve_load_model" "${model}" --from models/toy-base
load=("${BIN}/serve_load" --clients "${CLIENTS}" --turns "${TURNS}"
  --first-tokens "${FIRST}" --turn-tokens "${TURN}" --max-tokens "${MAX}" --min-id 3 --vocab 259)

wait_ready() {
  for _ in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; then return 0; fi
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

policy=(--policy "${POLICY}")
request=(--kv-policy "${POLICY}")
if [[ -n ${BUDGET} ]]; then
  policy+=(--budget "${BUDGET}")
  request+=(--kv-budget "${BUDGET}")
fi
"${BIN}/kvevict-llama" serve "${model}" --port "${PORT}" --np "${PARALLEL}" -c "${CELLS}" \
  --kv-pool "${POOL}" --kv-type f16 --chunk "${CHUNK}" -t "${THREADS}" --queue "${CLIENTS}" \
  --max-tokens-limit "${MAX}" "${policy[@]}" >/dev/null 2>&1 &
kvevict=$!
wait_ready "${PORT}"
echo -n "kvevict-llama serve (${POLICY} ${BUDGET}, pool ${POOL}): "
"${load[@]}" --port "${PORT}" "${request[@]}" --server-pid "${kvevict}" || true
stop "${kvevict}"

# The next port: the first one's closed connections may still hold it (TIME_WAIT), and
# llama-server's listener does not reuse such an address.
"${llama_server}" -m "${model}" --host 127.0.0.1 --port "$((PORT + 1))" -np "${PARALLEL}" \
  -c "${CELLS}" -t "${THREADS}" -tb "${THREADS}" --context-shift >/dev/null 2>&1 &
llama=$!
wait_ready "$((PORT + 1))"
echo -n "llama-server (context shift, -c ${CELLS}): "
"${load[@]}" --port "$((PORT + 1))" --protocol llama-server --server-pid "${llama}" || true
stop "${llama}"
