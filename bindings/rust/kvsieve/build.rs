// SPDX-License-Identifier: Apache-2.0
// kvsieve-sys found the library through pkg-config and passes its folder on (DEP_KVSIEVE_LIBDIR):
// an rpath to it lets this crate's tests run without LD_LIBRARY_PATH. (An rpath set
// by a build script reaches only the package's own binaries; an application depending on this
// crate sets its own, or installs kvsieve where the loader looks.)
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_KVSIEVE_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_KVSIEVE_LIBDIR") {
        println!("cargo:rustc-link-arg-tests=-Wl,-rpath,{dir}");
    }
}
