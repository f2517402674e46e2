# Each public header must compile on its own (the self-contained-include test of CCCL and Kokkos).
# One generated translation unit per header; a header that needs an optional dependency says so
# on a line "// mrr-requires: <target>" and is checked only when that target exists.
#
# Compiling alone is not enough for an entry point: mrr/moe.hpp compiled, yet composing a layer
# with it alone failed (router_for_t<CpuBackend> named a router it only declared). So each entry
# point -- mrr/mrr.hpp and every umbrella mrr/<area>.hpp over a folder mrr/<area>/ -- also has
# tests/headers/<area>.cpp, which includes it alone and uses what it promises; one is required.
function(mrr_add_header_checks)
  file(GLOB_RECURSE headers RELATIVE ${PROJECT_SOURCE_DIR}/include CONFIGURE_DEPENDS
       ${PROJECT_SOURCE_DIR}/include/mrr/*.hpp)
  set(sources)
  set(libs)
  foreach(header IN LISTS headers)
    file(STRINGS ${PROJECT_SOURCE_DIR}/include/${header} requires REGEX "^// mrr-requires: ")
    set(ok TRUE)
    foreach(line IN LISTS requires)
      string(REGEX REPLACE "^// mrr-requires: *" "" dep "${line}")
      if(TARGET ${dep})
        list(APPEND libs ${dep})
      else()
        set(ok FALSE)
      endif()
    endforeach()
    if(NOT ok)
      continue()
    endif()
    string(REPLACE "/" "__" stem ${header})
    set(src ${CMAKE_CURRENT_BINARY_DIR}/header_checks/${stem}.cpp)
    file(CONFIGURE OUTPUT ${src} CONTENT "#include <${header}>\n#include <${header}>  // and include guards work\n")
    list(APPEND sources ${src})
  endforeach()
  file(GLOB entries RELATIVE ${PROJECT_SOURCE_DIR}/include/mrr CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/include/mrr/*.hpp)
  foreach(entry IN LISTS entries)
    string(REGEX REPLACE "\\.hpp$" "" area ${entry})
    if(NOT area STREQUAL "mrr" AND NOT IS_DIRECTORY ${PROJECT_SOURCE_DIR}/include/mrr/${area})
      continue()  # a single header, not an entry point over an area
    endif()
    set(use ${PROJECT_SOURCE_DIR}/tests/headers/${area}.cpp)
    if(NOT EXISTS ${use})
      message(FATAL_ERROR "mrr: entry point mrr/${entry} has no use check: add tests/headers/${area}.cpp, which "
                          "includes <mrr/${entry}> alone and uses what it provides")
    endif()
    list(APPEND sources ${use})
  endforeach()
  list(REMOVE_DUPLICATES libs)
  add_library(mrr_header_checks OBJECT ${sources})
  target_link_libraries(mrr_header_checks PRIVATE mrr::mrr mrr_warnings ${libs})
  add_test(NAME headers.self_contained
           COMMAND ${CMAKE_COMMAND} --build ${PROJECT_BINARY_DIR} --target mrr_header_checks)
  set_tests_properties(headers.self_contained PROPERTIES LABELS "headers")
endfunction()
