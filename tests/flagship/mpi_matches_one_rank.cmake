# Runs the trainer with 1 rank (threads) and with 2 MPI processes; the parameter and route digests
# printed in the summary must be equal.
set(args steps=2 batch=4 group=4 mini_batch=2 mode=R3 seed=7 --no-progress)
execute_process(COMMAND ${THREAD_EXE} ${args} out=${OUT}/threads OUTPUT_VARIABLE one RESULT_VARIABLE rc1 ERROR_VARIABLE err1)
execute_process(COMMAND ${MPIRUN} -np 2 ${MPI_EXE} ${args} out=${OUT}/mpi OUTPUT_VARIABLE two RESULT_VARIABLE rc2 ERROR_VARIABLE err2)
if(NOT rc1 EQUAL 0 OR NOT rc2 EQUAL 0)
  message(FATAL_ERROR "runs failed (${rc1}, ${rc2}):\n${one}\n${err1}\n${two}\n${err2}")
endif()
string(REGEX MATCH "digest=[0-9a-f]+ routes=[0-9a-f]+" d1 "${one}")
string(REGEX MATCH "digest=[0-9a-f]+ routes=[0-9a-f]+" d2 "${two}")
if(d1 STREQUAL "" OR NOT d1 STREQUAL d2)
  message(FATAL_ERROR "1 rank: '${d1}'\n2 MPI ranks: '${d2}'\n${one}\n${two}")
endif()
message(STATUS "1 rank and 2 MPI ranks agree: ${d1}")
