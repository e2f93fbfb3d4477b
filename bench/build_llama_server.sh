#!/usr/bin/env bash
# Builds llama.cpp's llama-server (CPU, static, the options kvevict builds llama.cpp with plus the
# server) for the side-by-side load of bench/serve_load (docs/serving.md, "Load"), and prints its
# path.
#
#   bench/build_llama_server.sh [LLAMA_CPP_SOURCE [BUILD_DIR]]
#
# The source tree: the argument, else $KVEVICT_LLAMA_CPP, else the KVEVICT_LLAMA_CPP of
# build/release/CMakeCache.txt, whichever is a llama.cpp source tree (an install prefix has no
# server sources). BUILD_DIR defaults to build/llama-server. Nothing is fetched: the web UI is
# neither built nor downloaded.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

is_tree() { [[ -n ${1:-} && -f $1/include/llama.h && -f $1/tools/server/CMakeLists.txt ]]; }
source_dir=${1:-}
if ! is_tree "${source_dir}"; then source_dir=${KVEVICT_LLAMA_CPP:-}; fi
if ! is_tree "${source_dir}" && [[ -f build/release/CMakeCache.txt ]]; then
  source_dir=$(grep '^KVEVICT_LLAMA_CPP:' build/release/CMakeCache.txt | cut -d= -f2- || true)
fi
if ! is_tree "${source_dir}"; then
  echo "build_llama_server: no llama.cpp source tree (with tools/server): give its path" >&2
  exit 2
fi
build_dir=${2:-build/llama-server}
launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
cmake -S "${source_dir}" -B "${build_dir}" -C cmake/llama_cpp_options.cmake \
  -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
  -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  >"${build_dir}.configure.log" 2>&1 || { tail -30 "${build_dir}.configure.log" >&2; exit 1; }
cmake --build "${build_dir}" --target llama-server -j "${JOBS:-2}" >&2
realpath "${build_dir}/bin/llama-server"
