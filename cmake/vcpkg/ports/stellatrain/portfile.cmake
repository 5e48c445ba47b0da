# SPDX-License-Identifier: Apache-2.0
# Overlay port that builds the package from this source tree:
#   vcpkg install stellatrain --overlay-ports=<repo>/cmake/vcpkg/ports
# (in manifest mode: "vcpkg-configuration": {"overlay-ports": ["<repo>/cmake/vcpkg/ports"]}).
# A registry port would fetch a release with vcpkg_from_github instead of SOURCE_PATH below.
set(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../../../..")

# Each feature turns into -DSTELLATRAIN_ENABLE_<X>=ON (OFF without it): cuda, and the
# transport components mpi, zmq and nccl. OFF matters: the build would otherwise pick up
# whatever CUDA, MPI, ZeroMQ or libnccl the host happens to have.
vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS
    FEATURES
        cuda STELLATRAIN_ENABLE_CUDA
        mpi STELLATRAIN_ENABLE_MPI
        zmq STELLATRAIN_ENABLE_ZMQ
        nccl STELLATRAIN_ENABLE_NCCL
)

set(VCPKG_BUILD_TYPE release) # header-only port

vcpkg_cmake_configure(
    SOURCE_PATH "${SOURCE_PATH}"
    OPTIONS
        -DSTELLATRAIN_BUILD_TESTS=OFF
        -DSTELLATRAIN_BUILD_BENCH=OFF
        -DSTELLATRAIN_BUILD_EXAMPLES=OFF
        -DSTELLATRAIN_INSTALL=ON
        ${FEATURE_OPTIONS}
)

vcpkg_cmake_install()

vcpkg_cmake_config_fixup(CONFIG_PATH share/stellatrain)
vcpkg_fixup_pkgconfig()  # share/pkgconfig: stellatrain.pc and one per transport component

file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/lib" "${CURRENT_PACKAGES_DIR}/share/doc")

vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
