# tools/plot_results.py on the output of the tiny eval grid (eval/configs/tiny.json).
#
# Included by tests/CMakeLists.txt, this file registers the test "tools.plot_results" where a
# python3 that imports matplotlib is found at configure time (`.ci/install-deps --plots` installs
# Debian's python3-matplotlib; CI does). Run by that test with `cmake -P`, it runs the grid with
# the build's kvevict and random-tiny model, plots it, and checks that every task's figure exists.

if(CMAKE_SCRIPT_MODE_FILE)
  # The test itself: KVEVICT, MODEL, PYTHON, SOURCE_DIR and WORK are given with -D.
  file(REMOVE_RECURSE ${WORK})
  execute_process(
    COMMAND ${KVEVICT} eval ${SOURCE_DIR}/eval/configs/tiny.json --model ${MODEL} --out
            ${WORK}/grid --jobs 1
    WORKING_DIRECTORY ${SOURCE_DIR} RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "kvevict eval tiny.json failed: ${status}")
  endif()
  execute_process(
    COMMAND ${PYTHON} ${SOURCE_DIR}/tools/plot_results.py ${WORK}/grid/results.json --out
            ${WORK}/plots RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "tools/plot_results.py failed: ${status}")
  endif()
  foreach(task stream_bpb passkey grocery cost)
    set(figure ${WORK}/plots/tiny-${task}.png)
    if(NOT EXISTS ${figure})
      message(FATAL_ERROR "tools/plot_results.py did not draw ${figure}")
    endif()
  endforeach()
  return()
endif()

# Registration. The sanitize build runs the same grid through test_eval already.
if(NOT TARGET kvevict_cli OR KVEVICT_SANITIZE)
  return()
endif()
find_package(Python3 COMPONENTS Interpreter QUIET)
set(_plot_python "")
# Debian's matplotlib is installed for /usr/bin/python3, which a python3 earlier in PATH may not be.
foreach(candidate IN ITEMS ${Python3_EXECUTABLE} /usr/bin/python3)
  if(NOT _plot_python AND EXISTS ${candidate})
    execute_process(COMMAND ${candidate} -c "import matplotlib" RESULT_VARIABLE _status
                    OUTPUT_QUIET ERROR_QUIET)
    if(_status EQUAL 0)
      set(_plot_python ${candidate})
    endif()
  endif()
endforeach()
if(NOT _plot_python)
  message(STATUS "tools.plot_results test not registered: no python3 with matplotlib "
                 "(.ci/install-deps --plots installs python3-matplotlib)")
  return()
endif()
message(STATUS "tools.plot_results test: ${_plot_python}")
add_test(
  NAME tools.plot_results
  COMMAND
    ${CMAKE_COMMAND} -DKVEVICT=$<TARGET_FILE:kvevict_cli> -DMODEL=${CMAKE_BINARY_DIR}/models/random-tiny.gguf
    -DPYTHON=${_plot_python} -DSOURCE_DIR=${PROJECT_SOURCE_DIR}
    -DWORK=${CMAKE_CURRENT_BINARY_DIR}/plot_results -P ${CMAKE_CURRENT_LIST_FILE})
