// SPDX-License-Identifier: Apache-2.0
// Links the installed kvsieve found by the `pkg-config` command (no crates: the crate builds with
// `cargo build --offline`). Point it at an install with PKG_CONFIG_PATH=<prefix>/lib/pkgconfig.
// Passes the library folder on as DEP_KVSIEVE_LIBDIR to the build scripts of crates that depend on
// this one (the safe `kvsieve` crate uses it to put an rpath into its tests).
use std::process::Command;

fn pkg_config(args: &[&str]) -> String {
    let out = Command::new("pkg-config")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("kvsieve-sys: cannot run pkg-config ({e}); install it (Debian: pkg-config)"));
    if !out.status.success() {
        panic!(
            "kvsieve-sys: `pkg-config {}` failed: {}\nSet PKG_CONFIG_PATH=<kvsieve prefix>/lib/pkgconfig.",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8(out.stdout).expect("pkg-config printed non-UTF-8")
}

fn main() {
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_LIBDIR");
    println!("cargo:rerun-if-changed=build.rs");
    let version = pkg_config(&["--modversion", "kvsieve"]);
    let version = version.trim();
    for flag in pkg_config(&["--libs", "kvsieve"]).split_whitespace() {
        if let Some(dir) = flag.strip_prefix("-L") {
            println!("cargo:rustc-link-search=native={dir}");
            println!("cargo:libdir={dir}");
        } else if let Some(lib) = flag.strip_prefix("-l") {
            println!("cargo:rustc-link-lib=dylib={lib}");
        }
    }
    let includedir = pkg_config(&["--variable=includedir", "kvsieve"]);
    println!("cargo:include={}", includedir.trim());
    println!("cargo:version={version}");
}
