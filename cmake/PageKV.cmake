# Helpers that keep each module's CMakeLists.txt a few lines long.
#
#   pagekv_library(NAME SOURCES a.cc b.cc DEPS other_module_targets... [PUBLIC_DEPS ...])
#   pagekv_test(NAME SOURCES a_test.cc DEPS ... [LABEL unit])
#   pagekv_benchmark(NAME SOURCES a_bench.cc DEPS ...)
#   pagekv_fuzzer(NAME SOURCE a_fuzzer.cc LIBRARY module_target...)

function(pagekv_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  # include/ (and the generated pagekv/version.h beside it in the build) and src/.
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR}/include ${PROJECT_BINARY_DIR}/include ${PROJECT_SOURCE_DIR}/src)
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
  # One main() for all: the machine into the benchmark's context.
  add_executable(${name} ${ARG_SOURCES} ${PROJECT_SOURCE_DIR}/src/kernels/bench_main.cc)
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} pagekv_kernels benchmark::benchmark)
  set_property(GLOBAL APPEND PROPERTY PAGEKV_BENCHMARKS ${name})
endfunction()

# A libFuzzer target over one module's libraries, built in the ASan + UBSan
# build (clang; the asan preset turns PAGEKV_BUILD_FUZZERS on): only those
# libraries, the parsers the fuzzer drives, carry libFuzzer's coverage
# instrumentation, and the fuzzer links the same objects the ASan tests
# run. `make fuzz` runs every one.
function(pagekv_fuzzer name)
  if(NOT PAGEKV_BUILD_FUZZERS)
    return()
  endif()
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "PAGEKV_BUILD_FUZZERS needs clang (libFuzzer)")
  endif()
  cmake_parse_arguments(ARG "" "SOURCE" "LIBRARY" ${ARGN})
  foreach(lib ${ARG_LIBRARY})
    get_target_property(opts ${lib} COMPILE_OPTIONS)
    if(NOT opts MATCHES "fuzzer-no-link")  # a library two fuzzers share
      target_compile_options(${lib} PRIVATE -fsanitize=fuzzer-no-link)
    endif()
  endforeach()
  add_executable(${name} ${ARG_SOURCE})
  target_compile_options(${name} PRIVATE -fsanitize=fuzzer-no-link)
  target_link_libraries(${name} PRIVATE ${ARG_LIBRARY})
  target_link_options(${name} PRIVATE -fsanitize=fuzzer)
endfunction()
