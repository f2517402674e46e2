# The flagship under mpirun with one rank's replay file missing: that rank fails alone, while
# its peers are already exchanging. Records per-rank route files with NP ranks, deletes rank
# MISSING's, then replays: the job must end non-zero within LIMIT s, the failing rank naming the
# missing file and every other rank naming the rank that left (run_expect_failure.cmake).
# cmake -DMPIRUN=... -DEXE=moe_grpo_mpi -DNP=4 -DMISSING=2 -DOUT=dir -DLIMIT=60 -P this.cmake
file(REMOVE_RECURSE ${OUT})
file(MAKE_DIRECTORY ${OUT})
set(args steps=1 batch=4 group=4 mini_batch=2 mode=R2 --no-progress out=${OUT})
set(routes ${OUT}/routes.mrr)
execute_process(COMMAND ${MPIRUN} -np ${NP} ${EXE} ${args} actor_rollout_ref.actor.router_replay.record_file=${routes}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0 OR NOT EXISTS ${routes}.rank${MISSING})
  message(FATAL_ERROR "recording the route files failed (${rc}):\n${out}")
endif()
file(REMOVE ${routes}.rank${MISSING})

set(CMD ${MPIRUN} -np ${NP} ${EXE} ${args} actor_rollout_ref.actor.router_replay.replay_file=${routes})
set(EXPECT "route file [^\n]*routes.mrr.rank${MISSING} does not exist")
set(REPORT "rank ${MISSING} has destroyed its MpiCommunicator")
math(EXPR REPORTS "${NP} - 1")
include(${CMAKE_CURRENT_LIST_DIR}/run_expect_failure.cmake)
