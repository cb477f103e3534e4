# cmake -DCLI=<trainscale-bench> -DARGS=<list> -P expect_exit.cmake, with EXPECTED_EXIT in the
# environment: fails unless the CLI exits with that code and prints something on stderr.
execute_process(COMMAND ${CLI} ${ARGS} RESULT_VARIABLE code ERROR_VARIABLE err OUTPUT_QUIET)
if(NOT code STREQUAL "$ENV{EXPECTED_EXIT}")
  message(FATAL_ERROR "trainscale-bench ${ARGS}: exit ${code}, expected $ENV{EXPECTED_EXIT}; stderr: ${err}")
endif()
if(err STREQUAL "")
  message(FATAL_ERROR "trainscale-bench ${ARGS}: no message on stderr")
endif()
message(STATUS "exit ${code}: ${err}")
