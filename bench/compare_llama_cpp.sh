#!/usr/bin/env bash
# kvevict's reference decoder against llama.cpp on the same GGUF files, one thread.
#
#   bench/compare_llama_cpp.sh [kvevict build dir, default build/release] [rounds, default 3]
#
# Writes a stories15M-shaped Llama with random weights (bench/pp_tg.cpp --write-stories15m) in
# F32, F16, Q8_0 and Q4_0 with kvevict's own GGUF writer, then for each round and type runs
# llama-bench (-p 512 -n 128 -t 1 -r 5) and kvevict's bench/pp_tg (the same two tests, same
# repetitions) one after the other, and prints per type the median over the rounds of the
# per-round ratio kvevict / llama.cpp of mean tokens/s:
#
#   ratio <type> tg128 <median>
#   ratio <type> pp512 <median>
#
# llama-bench: $LLAMA_BENCH if set; else the first of /var/tmp/llama-build/build/bin/llama-bench and
# /var/tmp/llama-bench-build/build/bin/llama-bench that exists; else it is built into
# /var/tmp/llama-bench-build from /work/shared/third_party/llama.cpp (or $LLAMA_CPP_DIR) as a
# portable CPU build (GGML_NATIVE=OFF, AVX, AVX2, FMA, F16C on: what a distribution would ship).
# kvevict's binary picks its best SIMD target at run time; KVEVICT_TARGET (e.g. AVX2) forces one.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-${repo}/build/release}"
rounds="${2:-3}"
pp_tg="${build}/bin/pp_tg"
[[ -x "${pp_tg}" ]] || { echo "compare_llama_cpp: ${pp_tg} not found (build kvevict first)" >&2; exit 1; }

find_llama_bench() {
  if [[ -n "${LLAMA_BENCH:-}" ]]; then
    echo "${LLAMA_BENCH}"
    return
  fi
  local candidate
  for candidate in /var/tmp/llama-build/build/bin/llama-bench /var/tmp/llama-bench-build/build/bin/llama-bench; do
    if [[ -x "${candidate}" ]]; then
      echo "${candidate}"
      return
    fi
  done
  local source="${LLAMA_CPP_DIR:-/work/shared/third_party/llama.cpp}"
  echo "compare_llama_cpp: building llama-bench into /var/tmp/llama-bench-build (once)" >&2
  cmake -S "${source}" -B /var/tmp/llama-bench-build/build -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DGGML_OPENMP=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    >&2
  nice -n 10 cmake --build /var/tmp/llama-bench-build/build -j2 --target llama-bench >&2
  echo /var/tmp/llama-bench-build/build/bin/llama-bench
}
llama_bench="$(find_llama_bench)"

work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
types=(f32 f16 q8_0 q4_0)
for type in "${types[@]}"; do
  "${pp_tg}" --write-stories15m "${work}/stories15m-${type}.gguf" --dtype "${type}"
done

target_args=()
[[ -n "${KVEVICT_TARGET:-}" ]] && target_args=(--target "${KVEVICT_TARGET}")

# "<test> <tokens/s>" lines of llama-bench's CSV (columns found by name).
llama_rates() {
  "${llama_bench}" -m "$1" -p 512 -n 128 -t 1 -r 5 -o csv 2>/dev/null | awk -F, '
    NR == 1 { for (i = 1; i <= NF; ++i) { gsub(/"/, "", $i); column[$i] = i }; next }
    { gsub(/"/, "");
      test = $column["n_prompt"] > 0 ? "pp" $column["n_prompt"] : "tg" $column["n_gen"];
      print test, $column["avg_ts"] }'
}

for ((round = 1; round <= rounds; ++round)); do
  for type in "${types[@]}"; do
    model="${work}/stories15m-${type}.gguf"
    llama_rates "${model}" > "${work}/llama"
    "${pp_tg}" --model "${model}" -p 512 -n 128 -r 5 "${target_args[@]}" > "${work}/kvevict"
    echo "round ${round} ${type} (load $(cut -d' ' -f1-3 /proc/loadavg)):" \
      "kvevict $(grep -h '^target' "${work}/kvevict")" \
      "$(awk '/^(pp|tg)/ { printf "%s %s  ", $1, $2 }' "${work}/kvevict")" \
      "llama.cpp $(awk '{ printf "%s %s  ", $1, $2 }' "${work}/llama")" >&2
    for test in tg128 pp512; do
      ours="$(awk -v t="${test}" '$1 == t { print $2 }' "${work}/kvevict")"
      theirs="$(awk -v t="${test}" '$1 == t { print $2 }' "${work}/llama")"
      awk -v a="${ours}" -v b="${theirs}" 'BEGIN { printf "%.4f\n", a / b }' \
        >> "${work}/ratios-${type}-${test}"
    done
  done
done

for type in "${types[@]}"; do
  for test in tg128 pp512; do
    median="$(sort -g "${work}/ratios-${type}-${test}" | awk '{ v[NR] = $1 } END {
      print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }')"
    echo "ratio ${type} ${test} ${median}"
  done
done
