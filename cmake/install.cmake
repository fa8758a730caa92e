# SPDX-License-Identifier: Apache-2.0
# cmake --install: headers, the shared library (SONAME = ABI major), the CLI (RPATH to the installed
# library), the CMake package (find_package(kvsieve) -> kvsieve::kvsieve) and kvsieve.pc.
include(CMakePackageConfigHelpers)
set(KVS_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvsieve)

install(TARGETS kvsieve EXPORT kvsieveTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/kvsieve DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(KVS_BUILD_CLI)
  install(TARGETS kvsieve_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

install(EXPORT kvsieveTargets NAMESPACE kvsieve:: FILE kvsieveTargets.cmake DESTINATION ${KVS_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/kvsieveConfig.cmake.in
  ${PROJECT_BINARY_DIR}/kvsieveConfig.cmake INSTALL_DESTINATION ${KVS_CMAKE_DIR})
# The ABI is tied to the major version (SONAME), so only the same major is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/kvsieveConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/kvsieveConfig.cmake ${PROJECT_BINARY_DIR}/kvsieveConfigVersion.cmake
  DESTINATION ${KVS_CMAKE_DIR})

# pkg-config: relocatable (prefix from the .pc file's own place); Libs.private lists what a static
# link would need (the shared library resolves them itself through DT_NEEDED).
set(KVS_PC_LIBS_PRIVATE "-ldnnl -lopenblas -lmimalloc -lxxhash -lpthread")
if(KVS_WITH_CUDA)
  string(APPEND KVS_PC_LIBS_PRIVATE " -L${CUDAToolkit_LIBRARY_DIR} -lcudart_static -ldl -lrt")
endif()
file(RELATIVE_PATH KVS_PC_TO_PREFIX ${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_LIBDIR}/pkgconfig ${CMAKE_INSTALL_PREFIX})
configure_file(${PROJECT_SOURCE_DIR}/cmake/kvsieve.pc.in ${PROJECT_BINARY_DIR}/kvsieve.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/kvsieve.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
