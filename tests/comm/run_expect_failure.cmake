# Runs CMD (a ;-list) under `timeout LIMIT` and passes when it exits non-zero within the limit:
# 0 means a failure went unnoticed, 124 (timeout's code) means it hung.
# cmake -DCMD=... -DLIMIT=60 -P run_expect_failure.cmake
execute_process(COMMAND timeout --kill-after=10 ${LIMIT} ${CMD} RESULT_VARIABLE rc)
if(rc STREQUAL "0")
  message(FATAL_ERROR "expected a non-zero exit, got 0: the failure went unnoticed")
elseif(rc STREQUAL "124" OR rc STREQUAL "137")
  message(FATAL_ERROR "still running after ${LIMIT} s (exit ${rc}): the job hung instead of failing")
endif()
message(STATUS "exited with ${rc} within ${LIMIT} s, as expected")
