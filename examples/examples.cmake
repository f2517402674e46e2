# The numbered examples, and the README's usage example, extracted from README.md so the code
# users copy is the code that is compiled and run.
mrr_add_example(00_quickstart_replay SOURCES 00_quickstart_replay.cpp
                ARGS ${CMAKE_CURRENT_BINARY_DIR}/quickstart_routes.mrr)
# The hint it prints names an interpreter that has numpy (or says to install it).
if(MRR_PYTHON_WITH_NUMPY)
  target_compile_definitions(00_quickstart_replay PRIVATE MRR_PYTHON_WITH_NUMPY="${MRR_PYTHON_WITH_NUMPY}")
endif()
target_compile_definitions(00_quickstart_replay PRIVATE
                           MRR_READ_ROUTES_PY="${PROJECT_SOURCE_DIR}/examples/python/read_routes.py")
mrr_add_example(01_moe_layer SOURCES 01_moe_layer.cpp)

file(READ ${PROJECT_SOURCE_DIR}/README.md _readme)
string(FIND "${_readme}" "<!-- readme-example -->" _begin)
string(FIND "${_readme}" "<!-- /readme-example -->" _end)
if(_begin EQUAL -1 OR _end EQUAL -1)
  message(FATAL_ERROR "README.md must hold its usage example between <!-- readme-example --> and <!-- /readme-example -->")
endif()
math(EXPR _len "${_end} - ${_begin}")
string(SUBSTRING "${_readme}" ${_begin} ${_len} _example)
string(REGEX REPLACE "^<!-- readme-example -->[^`]*```cpp\n" "" _example "${_example}")
string(REGEX REPLACE "```[ \n]*$" "" _example "${_example}")
file(CONFIGURE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/readme_example.cpp CONTENT "${_example}" @ONLY)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/README.md)
mrr_add_example(readme_example SOURCES ${CMAKE_CURRENT_BINARY_DIR}/readme_example.cpp)
