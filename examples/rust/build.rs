// SPDX-License-Identifier: Apache-2.0
// kvsieve-sys links the installed library (PKG_CONFIG_PATH=<prefix>/lib/pkgconfig); an rpath to
// its folder is the application's choice: this one takes it from pkg-config, so that it runs
// without LD_LIBRARY_PATH.
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let out =
        Command::new("pkg-config").args(["--variable=libdir", "kvsieve"]).output().expect("pkg-config: not found");
    let dir = String::from_utf8(out.stdout).unwrap();
    if out.status.success() && !dir.trim().is_empty() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.trim());
    }
}
