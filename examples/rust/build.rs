// SPDX-License-Identifier: Apache-2.0
// Finds the installed kvsieve through pkg-config (the `pkg-config` command, so that the example
// builds with `cargo --offline` and no crates): PKG_CONFIG_PATH=<prefix>/lib/pkgconfig.
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let out = Command::new("pkg-config")
        .args(["--libs", "kvsieve"])
        .output()
        .expect("pkg-config: not found");
    if !out.status.success() {
        panic!("pkg-config --libs kvsieve failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    for flag in String::from_utf8(out.stdout).unwrap().split_whitespace() {
        if let Some(dir) = flag.strip_prefix("-L") {
            println!("cargo:rustc-link-search=native={dir}");
            // run from the build tree without LD_LIBRARY_PATH
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        } else if let Some(lib) = flag.strip_prefix("-l") {
            println!("cargo:rustc-link-lib=dylib={lib}");
        }
    }
}
