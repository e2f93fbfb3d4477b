#!/usr/bin/env bash
# kvevict's reference decoder against llama.cpp on the same GGUF files, one thread (THREADS: more).
#
#   bench/compare_llama_cpp.sh [--llama-cpp DIR] [--shape NAME] [--types LIST] [--models DIR]
#                              [BUILD_DIR] [ROUNDS]
#
#   BUILD_DIR       kvevict's build directory, holding bin/pp_tg (default build/release)
#   ROUNDS          interleaved rounds per type (default 3)
#   --llama-cpp DIR your llama.cpp source tree, to build llama-bench from; default: the
#                   KVEVICT_LLAMA_CPP entry of BUILD_DIR/CMakeCache.txt, when it names a source tree
#   --shape NAME    stories15m (default) or tinyllama (TinyLlama-1.1B's shape, 0.85B weights)
#   --types LIST    comma-separated weight types; default f32,f16,q8_0,q4_0 for stories15m,
#                   f16,q8_0,q4_0 for tinyllama (its F32 file is 3.4 GB)
#   --models DIR    keep the written models in DIR (outside the repository) and use the ones
#                   already there (<shape>-<type>.gguf) instead of writing them again
#
# Writes a Llama of that shape with random weights (bench/pp_tg.cpp --write-stories15m or
# --write-tinyllama) in each type with kvevict's own GGUF writer, into a temporary directory
# (TMPDIR; tinyllama needs 3.1 GB there for the three default types) or --models, then for each
# round and type runs llama-bench (-p 512 -n N -t 1 -r R) and kvevict's bench/pp_tg (the same two
# tests, same repetitions) one after the other, N = 128 and R = 5 for stories15m, N = 32 and R = 2
# for tinyllama, and prints per type the median over the rounds of the per-round ratio
# kvevict / llama.cpp of mean tokens/s:
#
#   ratio <type> tg<N> <median>
#   ratio <type> pp512 <median>
#
# and for Q8_0 and Q4_0 one more line, kvevict decoding with 8-bit activations and integer
# products as llama.cpp does (pp_tg --decode-activations q8_0; the default keeps f32 ones):
#
#   ratio <type> tg<N> decode-activations=q8_0 <median>
#
# llama-bench: $LLAMA_BENCH if set; else BUILD_DIR/llama-bench/bin/llama-bench if it exists; else
# it is built there (once) from the llama.cpp source tree (--llama-cpp, or the build's
# KVEVICT_LLAMA_CPP) with the instruction sets of kvevict's own llama.cpp build, so that both
# programs use what this CPU has (AVX-512 included) and the comparison is at equal width:
#
#   cmake -S <your llama.cpp source tree> -B BUILD_DIR/llama-bench \
#     -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON \
#     -C cmake/llama_cpp_options.cmake   # GGML_NATIVE=OFF, AVX..AVX-512 from /proc/cpuinfo, AMX off
#   cmake --build BUILD_DIR/llama-bench --target llama-bench -j2
#
# THREADS (default 1) runs both programs at that many threads (-t), for the thread speed-up.
# kvevict's binary picks its best SIMD target at run time; KVEVICT_TARGET (e.g. AVX2) forces one,
# to be compared with a llama-bench of that width given as LLAMA_BENCH (a portable build with
# GGML_NATIVE=OFF and only GGML_AVX, GGML_AVX2, GGML_FMA, GGML_F16C on).
set -euo pipefail
shopt -s inherit_errexit

usage() { sed -n '4,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
fail() { echo "compare_llama_cpp: $*" >&2; exit 1; }

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
llama_cpp=""
shape="stories15m"
types_list=""
models=""
positional=()
while (($# > 0)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --llama-cpp) (($# >= 2)) || fail "--llama-cpp needs a directory"; llama_cpp="$2"; shift 2 ;;
    --llama-cpp=*) llama_cpp="${1#--llama-cpp=}"; shift ;;
    --shape) (($# >= 2)) || fail "--shape needs a name"; shape="$2"; shift 2 ;;
    --shape=*) shape="${1#--shape=}"; shift ;;
    --types) (($# >= 2)) || fail "--types needs a list"; types_list="$2"; shift 2 ;;
    --types=*) types_list="${1#--types=}"; shift ;;
    --models) (($# >= 2)) || fail "--models needs a directory"; models="$2"; shift 2 ;;
    --models=*) models="${1#--models=}"; shift ;;
    -*) usage >&2; fail "unknown option $1" ;;
    *) positional+=("$1"); shift ;;
  esac
done
((${#positional[@]} <= 2)) || { usage >&2; fail "too many arguments: ${positional[*]}"; }
build="${positional[0]:-${repo}/build/release}"
rounds="${positional[1]:-3}"
[[ "${rounds}" =~ ^[1-9][0-9]*$ ]] || fail "ROUNDS must be a positive integer, got '${rounds}'"
case "${shape}" in
  stories15m) default_types="f32,f16,q8_0,q4_0"; generate=128; repetitions=5 ;;
  tinyllama) default_types="f16,q8_0,q4_0"; generate=32; repetitions=2 ;;
  *) fail "--shape must be stories15m or tinyllama, got '${shape}'" ;;
esac
IFS=, read -r -a types <<< "${types_list:-${default_types}}"
((${#types[@]} > 0)) || fail "--types is empty"
for type in "${types[@]}"; do
  [[ "${type}" =~ ^(f32|f16|bf16|q8_0|q4_0)$ ]] \
    || fail "--types: '${type}' is not one of f32, f16, bf16, q8_0, q4_0"
done
pp_tg="${build}/bin/pp_tg"
[[ -x "${pp_tg}" ]] || fail "${pp_tg} not found (build kvevict first: cmake --build ${build} --target pp_tg)"

# The llama.cpp source tree llama-bench is built from: --llama-cpp, else the build's
# KVEVICT_LLAMA_CPP (CMakeCache.txt), which must then be a source tree, not an install prefix.
llama_cpp_source() {
  local source="${llama_cpp}" from="--llama-cpp"
  if [[ -z "${source}" ]]; then
    from="KVEVICT_LLAMA_CPP in ${build}/CMakeCache.txt"
    if [[ -f "${build}/CMakeCache.txt" ]]; then
      source="$(sed -n 's/^KVEVICT_LLAMA_CPP:[A-Z]*=//p' "${build}/CMakeCache.txt")"
    fi
    [[ -n "${source}" ]] || fail "no llama.cpp source tree to build llama-bench from:" \
      "pass --llama-cpp <your llama.cpp source tree>, configure ${build} with" \
      "-DKVEVICT_LLAMA_CPP=<your llama.cpp source tree>, or set LLAMA_BENCH to a llama-bench binary"
  fi
  [[ -f "${source}/CMakeLists.txt" && -d "${source}/tools/llama-bench" ]] \
    || fail "${from} is '${source}', which is not a llama.cpp source tree with tools/llama-bench" \
      "(an install prefix cannot build llama-bench): pass --llama-cpp <your llama.cpp source tree>" \
      "or set LLAMA_BENCH to a llama-bench binary"
  echo "${source}"
}

find_llama_bench() {
  if [[ -n "${LLAMA_BENCH:-}" ]]; then
    [[ -x "${LLAMA_BENCH}" ]] || fail "LLAMA_BENCH=${LLAMA_BENCH} is not an executable"
    echo "${LLAMA_BENCH}"
    return
  fi
  local dir="${build}/llama-bench"
  if [[ ! -x "${dir}/bin/llama-bench" ]]; then
    local source
    source="$(llama_cpp_source)"
    echo "compare_llama_cpp: building llama-bench from ${source} into ${dir} (once)" >&2
    cmake -S "${source}" -B "${dir}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_COMMON=ON \
      -DLLAMA_BUILD_TOOLS=ON -C "${repo}/cmake/llama_cpp_options.cmake" >&2
    nice -n 10 cmake --build "${dir}" -j2 --target llama-bench >&2
  fi
  echo "${dir}/bin/llama-bench"
}
llama_bench="$(find_llama_bench)"
echo "llama-bench: ${llama_bench}" >&2

work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
if [[ -n "${models}" ]]; then
  mkdir -p "${models}" || fail "--models: cannot create ${models}"
else
  models="${work}"
fi
for type in "${types[@]}"; do
  file="${models}/${shape}-${type}.gguf"
  [[ -s "${file}" ]] && continue
  # Written under another name first, so that an interrupted write is never taken for a model.
  "${pp_tg}" "--write-${shape}" "${file}.partial" --dtype "${type}" && mv "${file}.partial" "${file}" \
    || fail "pp_tg could not write the ${shape} model in ${type} to ${models}"
done

threads="${THREADS:-1}"
target_args=()
[[ -n "${KVEVICT_TARGET:-}" ]] && target_args=(--target "${KVEVICT_TARGET}")

# "<test> <tokens/s>" lines of llama-bench's CSV (columns found by name).
llama_rates() {
  "${llama_bench}" -m "$1" -p 512 -n "${generate}" -t "${threads}" -r "${repetitions}" -o csv 2>/dev/null | awk -F, '
    NR == 1 { for (i = 1; i <= NF; ++i) { gsub(/"/, "", $i); column[$i] = i }; next }
    { gsub(/"/, "");
      test = $column["n_prompt"] > 0 ? "pp" $column["n_prompt"] : "tg" $column["n_gen"];
      print test, $column["avg_ts"] }'
}

# Appends kvevict's tokens/s over llama.cpp's for one test: <kvevict output> <test> <ratios file>.
ratio() {
  local ours theirs
  ours="$(awk -v t="$2" '$1 == t { print $2 }' "$1")"
  theirs="$(awk -v t="$2" '$1 == t { print $2 }' "${work}/llama")"
  awk -v a="${ours}" -v b="${theirs}" 'BEGIN { printf "%.4f\n", a / b }' >> "$3"
}

for ((round = 1; round <= rounds; ++round)); do
  for type in "${types[@]}"; do
    model="${models}/${shape}-${type}.gguf"
    llama_rates "${model}" > "${work}/llama"
    "${pp_tg}" --model "${model}" -p 512 -n "${generate}" -r "${repetitions}" -t "${threads}" \
      "${target_args[@]}" > "${work}/kvevict"
    echo "round ${round} ${type} (load $(cut -d' ' -f1-3 /proc/loadavg)):" \
      "kvevict $(grep -h '^target' "${work}/kvevict")" \
      "$(awk '/^(pp|tg)/ { printf "%s %s  ", $1, $2 }' "${work}/kvevict")" \
      "llama.cpp $(awk '{ printf "%s %s  ", $1, $2 }' "${work}/llama")" >&2
    for test in "tg${generate}" pp512; do ratio "${work}/kvevict" "${test}" "${work}/ratios-${type}-${test}"; done
    if [[ "${type}" == q8_0 || "${type}" == q4_0 ]]; then
      "${pp_tg}" --model "${model}" -p 16 -n "${generate}" -r "${repetitions}" -t "${threads}" \
        "${target_args[@]}" --decode-activations q8_0 > "${work}/kvevict-q8"
      echo "round ${round} ${type} kvevict decode-activations=q8_0:" \
        "$(awk '/^tg/ { printf "%s %s", $1, $2 }' "${work}/kvevict-q8")" >&2
      ratio "${work}/kvevict-q8" "tg${generate}" "${work}/ratios-${type}-tg-q8"
    fi
  done
done

median() {
  sort -g "$1" | awk '{ v[NR] = $1 } END {
    print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'
}
for type in "${types[@]}"; do
  for test in "tg${generate}" pp512; do
    echo "ratio ${type} ${test} $(median "${work}/ratios-${type}-${test}")"
  done
  if [[ -f "${work}/ratios-${type}-tg-q8" ]]; then
    echo "ratio ${type} tg${generate} decode-activations=q8_0 $(median "${work}/ratios-${type}-tg-q8")"
  fi
done
