# The llama.cpp build kvevict's integration uses (src/llama): static, CPU only, nothing fetched.
# Used two ways, one list of options:
#   - as an initial cache for a standalone llama.cpp build installed as a prefix (.ci/run):
#       cmake -S llama.cpp -B build -C <kvevict>/cmake/llama_cpp_options.cmake ...
#   - included by src/llama/CMakeLists.txt before add_subdirectory(<llama.cpp source tree>).
#
# Instruction sets are explicit (GGML_NATIVE=OFF), chosen from /proc/cpuinfo: the development
# machines report AMX, and a native build sends Q8_0 matrix products through ggml's AMX path, which
# has crashed there. AMX stays off; AVX-512 is on where the CPU has it.
set(BUILD_SHARED_LIBS OFF CACHE BOOL "llama.cpp: static libraries")
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "")
set(LLAMA_BUILD_TESTS OFF CACHE BOOL "")
set(LLAMA_BUILD_TOOLS OFF CACHE BOOL "")
set(LLAMA_BUILD_EXAMPLES OFF CACHE BOOL "")
set(LLAMA_BUILD_SERVER OFF CACHE BOOL "")
set(LLAMA_BUILD_APP OFF CACHE BOOL "")
set(LLAMA_BUILD_UI OFF CACHE BOOL "")
set(LLAMA_CURL OFF CACHE BOOL "")
set(LLAMA_OPENSSL OFF CACHE BOOL "")
set(GGML_OPENMP OFF CACHE BOOL "ggml's own thread pool: no libgomp to link")
set(GGML_NATIVE OFF CACHE BOOL "")
set(GGML_AMX_TILE OFF CACHE BOOL "")
set(GGML_AMX_INT8 OFF CACHE BOOL "")
set(GGML_AMX_BF16 OFF CACHE BOOL "")

set(_kvevict_cpu_flags "")
if(EXISTS /proc/cpuinfo)
  file(STRINGS /proc/cpuinfo _kvevict_cpu_flags REGEX "^flags" LIMIT_COUNT 1)
endif()
# GGML option -> the /proc/cpuinfo flag it needs.
foreach(
  _kvevict_pair IN
  ITEMS GGML_AVX:avx
        GGML_AVX2:avx2
        GGML_FMA:fma
        GGML_F16C:f16c
        GGML_BMI2:bmi2
        GGML_AVX512:avx512f
        GGML_AVX512_VBMI:avx512vbmi
        GGML_AVX512_VNNI:avx512_vnni
        GGML_AVX512_BF16:avx512_bf16)
  string(REPLACE ":" ";" _kvevict_pair "${_kvevict_pair}")
  list(GET _kvevict_pair 0 _kvevict_option)
  list(GET _kvevict_pair 1 _kvevict_flag)
  if(" ${_kvevict_cpu_flags} " MATCHES " ${_kvevict_flag} ")
    set(${_kvevict_option} ON CACHE BOOL "from /proc/cpuinfo (${_kvevict_flag})")
  else()
    set(${_kvevict_option} OFF CACHE BOOL "not in /proc/cpuinfo (${_kvevict_flag})")
  endif()
endforeach()
