# The issue's command line: R2 with a record_file died at step 11, once the file passed the 1 MiB
# the writer had mapped ("row 2058 repeats expert id 0"), where the memory store trained on. Both
# runs must now train bitwise the same model and routes (same digests), the file well past 1 MiB.
# The record_file lies inside the run's `out`, which does not exist yet: the run creates it first.
set(args --no-progress steps=14 batch=64 mini_batch=64 mode=R2 seed=3)
file(REMOVE_RECURSE ${OUT}/file)
file(MAKE_DIRECTORY ${OUT})
execute_process(COMMAND ${EXE} ${args} out=${OUT}/memory OUTPUT_VARIABLE mem RESULT_VARIABLE rc1 ERROR_VARIABLE err1)
execute_process(COMMAND ${EXE} ${args} out=${OUT}/file
                        actor_rollout_ref.actor.router_replay.record_file=${OUT}/file/big_r2.mrr
                OUTPUT_VARIABLE fil RESULT_VARIABLE rc2 ERROR_VARIABLE err2)
if(NOT rc1 EQUAL 0 OR NOT rc2 EQUAL 0)
  message(FATAL_ERROR "runs failed (memory ${rc1}, record_file ${rc2}):\n${mem}\n${err1}\n${fil}\n${err2}")
endif()
file(SIZE ${OUT}/file/big_r2.mrr bytes)
if(bytes LESS 1500000)
  message(FATAL_ERROR "the route file holds only ${bytes} bytes; the check needs one past 1 MiB")
endif()
string(REGEX MATCH "digest=[0-9a-f]+ routes=[0-9a-f]+" d1 "${mem}")
string(REGEX MATCH "digest=[0-9a-f]+ routes=[0-9a-f]+" d2 "${fil}")
if(d1 STREQUAL "" OR NOT d1 STREQUAL d2)
  message(FATAL_ERROR "memory store: '${d1}'\nrecord_file: '${d2}'\n${mem}\n${fil}")
endif()
message(STATUS "memory store and a ${bytes}-byte record_file agree: ${d1}")
