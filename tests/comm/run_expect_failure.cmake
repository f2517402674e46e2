# Runs CMD (a ;-list) under `timeout LIMIT` and passes when it exits non-zero within the limit:
# 0 means a failure went unnoticed, 124 (timeout's code) means it hung. Each regex of EXPECT (a
# ;-list, optional) must match the output (stdout and stderr together), so the job ended for the
# reason the test provokes, with a message that names it; REPORT (a regex, optional) must match
# exactly REPORTS times: one report from each rank the failure reached.
# cmake -DCMD=... -DLIMIT=60 [-DEXPECT=...] [-DREPORT=... -DREPORTS=3] -P run_expect_failure.cmake
# (or include() it with those variables set)
execute_process(COMMAND timeout --kill-after=10 ${LIMIT} ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE out)
message("${out}")
if(rc STREQUAL "0")
  message(FATAL_ERROR "expected a non-zero exit, got 0: the failure went unnoticed")
elseif(rc STREQUAL "124" OR rc STREQUAL "137")
  message(FATAL_ERROR "still running after ${LIMIT} s (exit ${rc}): the job hung instead of failing")
endif()
foreach(pattern IN LISTS EXPECT)
  if(NOT out MATCHES "${pattern}")
    message(FATAL_ERROR "exited with ${rc}, but the output does not match '${pattern}'")
  endif()
endforeach()
if(NOT "${REPORT}" STREQUAL "")
  string(REGEX MATCHALL "${REPORT}" reports "${out}")
  list(LENGTH reports reported)
  if(NOT reported EQUAL REPORTS)
    message(FATAL_ERROR "'${REPORT}' was reported ${reported} times; expected once from each of ${REPORTS} ranks")
  endif()
endif()
message(STATUS "exited with ${rc} within ${LIMIT} s, as expected")
