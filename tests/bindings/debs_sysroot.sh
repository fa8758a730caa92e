# SPDX-License-Identifier: Apache-2.0
# Sourced (bash) by the GPU-machine scripts: when .debs/ holds kvsieve's Debian build dependencies
# as .deb files (the machine has no package registry), unpacks them into a private sysroot
# (/tmp/kvsieve-sysroot, never into /), makes the OpenBLAS links Debian's alternatives system would
# make, exports the loader/pkg-config/SWIG paths, and sets KVS_SYSROOT_ARGS to the CMake arguments
# that find them. Without .debs/ it only sets KVS_SYSROOT_ARGS=() (the machine has the packages).
KVS_SYSROOT_ARGS=()
if ls .debs/*.deb >/dev/null 2>&1; then
  _sr=/tmp/kvsieve-sysroot
  _lib=$_sr/usr/lib/x86_64-linux-gnu
  mkdir -p "$_sr"
  for _d in .debs/*.deb; do dpkg -x "$_d" "$_sr"; done
  for _f in libopenblas.so libopenblas.so.0 libblas.so libblas.so.3; do
    [ -e "$_lib/$_f" ] || ln -sf "openblas-pthread/$_f" "$_lib/$_f"
  done
  export LD_LIBRARY_PATH=$_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PKG_CONFIG_PATH=$_lib/pkgconfig PKG_CONFIG_SYSROOT_DIR=$_sr SWIG_LIB=$_sr/usr/share/swig4.0
  KVS_SYSROOT_ARGS=("-DCMAKE_PREFIX_PATH=$_sr/usr;$_lib/cmake" "-DSWIG_EXECUTABLE=$_sr/usr/bin/swig4.0"
                    "-DCMAKE_CXX_FLAGS=-I$_sr/usr/include" "-DCMAKE_C_FLAGS=-I$_sr/usr/include")
fi
