# Helpers that keep each module's CMakeLists.txt a few lines long.
#
#   pagekv_library(NAME SOURCES a.cc b.cc DEPS other_module_targets... [PUBLIC_DEPS ...])
#   pagekv_test(NAME SOURCES a_test.cc DEPS ... [LABEL unit])
#   pagekv_benchmark(NAME SOURCES a_bench.cc DEPS ...)

function(pagekv_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${name} PUBLIC ${ARG_DEPS})
endfunction()

function(pagekv_test name)
  if(NOT PAGEKV_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(ARG "" "LABEL" "SOURCES;DEPS" ${ARGN})
  if(NOT ARG_LABEL)
    set(ARG_LABEL unit)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gtest_main)
  # Tests read ../shared relative to the repository root.
  gtest_discover_tests(${name}
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
    DISCOVERY_MODE PRE_TEST
    NO_PRETTY_VALUES
    PROPERTIES LABELS ${ARG_LABEL})
endfunction()

function(pagekv_benchmark name)
  if(NOT PAGEKV_BUILD_BENCHMARKS)
    return()
  endif()
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} benchmark::benchmark)
  set_property(GLOBAL APPEND PROPERTY PAGEKV_BENCHMARKS ${name})
endfunction()
