# The installable library: libpagekv (static by default; shared with
# PAGEKV_BUILD_SHARED) holding every module's objects, the public headers
# (include/pagekv only), a CMake package (find_package(PageKV) ->
# PageKV::pagekv) and a pkg-config file. `cmake --install <build>` puts
# them under CMAKE_INSTALL_PREFIX; examples/embed is a consumer.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
find_package(PkgConfig REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(Threads REQUIRED)
# The same pkg-config modules the modules use, as imported targets here
# (theirs are local to their folders); PageKVConfig.cmake makes the same
# ones for a consumer of the static library.
pkg_check_modules(PAGEKV_DEP_ZMQ REQUIRED IMPORTED_TARGET libzmq)
pkg_check_modules(PAGEKV_DEP_HIREDIS REQUIRED IMPORTED_TARGET hiredis)
pkg_check_modules(PAGEKV_DEP_XXHASH REQUIRED IMPORTED_TARGET libxxhash)
pkg_check_modules(PAGEKV_DEP_PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(PAGEKV_DEP_HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)

set(PAGEKV_MODULE_LIBRARIES pagekv_router pagekv_server pagekv_http pagekv_engine pagekv_scheduler pagekv_model pagekv_bench
    pagekv_tiers pagekv_prefix pagekv_kernels pagekv_evict pagekv_kvcache pagekv_layout pagekv_jinja pagekv_dist pagekv_base)
if(PAGEKV_HAVE_CUDA)
  # --device cuda: the CUDA backend and its kernels (no relocatable device
  # code, so their objects link like any other).
  list(APPEND PAGEKV_MODULE_LIBRARIES pagekv_cuda_backend pagekv_cuda)
endif()
if(PAGEKV_BUILD_SHARED)
  add_library(pagekv SHARED)
  set(dep_scope PRIVATE)  # a shared library carries its dependencies
else()
  add_library(pagekv STATIC)
  set(dep_scope PUBLIC)   # a static one passes them to whoever links it
endif()
foreach(m ${PAGEKV_MODULE_LIBRARIES})
  target_sources(pagekv PRIVATE $<TARGET_OBJECTS:${m}>)
endforeach()
set_target_properties(pagekv PROPERTIES VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}
                                        EXPORT_NAME pagekv LINKER_LANGUAGE CXX)
target_compile_features(pagekv INTERFACE cxx_std_20)
# Users see include/ and nothing else (the modules' own src/ stays private).
target_include_directories(pagekv PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
                                         $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>
                                         $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
target_link_libraries(pagekv ${dep_scope} fmt::fmt hwy::hwy OpenSSL::Crypto Threads::Threads PkgConfig::PAGEKV_DEP_ZMQ
                      PkgConfig::PAGEKV_DEP_HIREDIS PkgConfig::PAGEKV_DEP_XXHASH PkgConfig::PAGEKV_DEP_PCRE2
                      PkgConfig::PAGEKV_DEP_HTTPLIB)
if(PAGEKV_HAVE_CUDA)
  target_link_libraries(pagekv ${dep_scope} CUDA::cudart CUDA::cublas)
  set(PAGEKV_PC_CUDA " -L${CUDAToolkit_LIBRARY_DIR} -lcublas -lcudart")
else()
  set(PAGEKV_PC_CUDA "")
endif()
if(PAGEKV_HAVE_MPI)
  target_link_libraries(pagekv ${dep_scope} PkgConfig::DIST_MPI)
  set(PAGEKV_PC_MPI " mpi-c")
else()
  set(PAGEKV_PC_MPI "")
endif()
add_library(PageKV::pagekv ALIAS pagekv)

configure_file(${PROJECT_SOURCE_DIR}/cmake/version.h.in ${PROJECT_BINARY_DIR}/include/pagekv/version.h @ONLY)

install(TARGETS pagekv EXPORT PageKVTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/pagekv ${PROJECT_BINARY_DIR}/include/pagekv
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")
install(TARGETS pagekv_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT PageKVTargets NAMESPACE PageKV:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/PageKV)
set(PAGEKV_SHARED ${PAGEKV_BUILD_SHARED})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/PageKVConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/PageKVConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/PageKV)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/PageKVConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/PageKVConfig.cmake ${PROJECT_BINARY_DIR}/PageKVConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/PageKV)
configure_file(${PROJECT_SOURCE_DIR}/cmake/pagekv.pc.in ${PROJECT_BINARY_DIR}/pagekv.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/pagekv.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
