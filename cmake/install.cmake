# Install rules and the CMake package of the gdn library (included from the top CMakeLists).
#   <prefix>/include/gdn/            the public headers
#   <prefix>/lib/libgdn.a            the library (CPU backend, and the CUDA backend when built)
#   <prefix>/lib/cmake/gdn/          gdnConfig.cmake, gdnConfigVersion.cmake, gdnTargets*.cmake
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(GDN_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/gdn" CACHE STRING
    "Where gdnConfig.cmake is installed, relative to the prefix")

# A static library exports its private links as $<LINK_ONLY:...> (Threads, CUDA::cudart_static):
# the consumer's link needs them, its compile does not. gdnConfig.cmake finds each package
# that those targets come from.
install(TARGETS gdn EXPORT gdnTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/gdn DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT gdnTargets NAMESPACE gdn:: DESTINATION ${GDN_INSTALL_CMAKEDIR})

# What the config file must find again: recorded from this build, not re-detected there.
set(GDN_WITH_OPENMP OFF)
if(OpenMP_CXX_FOUND)
  set(GDN_WITH_OPENMP ON)
endif()
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/gdnConfig.cmake.in
  ${PROJECT_BINARY_DIR}/gdnConfig.cmake
  INSTALL_DESTINATION ${GDN_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API, so 0.1 accepts 0.1.y only.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/gdnConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/gdnConfig.cmake ${PROJECT_BINARY_DIR}/gdnConfigVersion.cmake
        DESTINATION ${GDN_INSTALL_CMAKEDIR})
