#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Proves that an installed kvsieve wheel does not depend on the system's libraries.

    VENV/bin/python scripts/check_wheel_deps.py

Run with the interpreter of the environment the wheel is installed in (scripts/test_wheel.sh does).
1. Linker level: ``ldd`` on every ELF file of the installed package (kvsieve/: the SWIG module,
   libkvsieve.so.0, the kvsieve command; kvsieve.libs/: what auditwheel bundled). Each library
   must resolve inside the installed package, except the few that manylinux lets a wheel take from
   the system (glibc's libraries, libstdc++, libgcc_s); one that is "not found" fails too.
2. Run time: a session decodes with each GEMM library (oneDNN, OpenBLAS); then no library of the
   bundled families (oneDNN, OpenBLAS, mimalloc, xxHash, libgomp, libgfortran, libquadmath, OpenCL)
   may be mapped into the process from outside the environment's site-packages (/proc/self/maps).
Prints what each file resolves to; exit status 1 on any violation.
"""
import os
import re
import subprocess
import sys

import kvsieve
import numpy as np

# What manylinux policies let a wheel load from the system (auditwheel's allow-list, x86-64).
SYSTEM = {"linux-vdso.so.1", "ld-linux-x86-64.so.2", "libc.so.6", "libm.so.6", "libpthread.so.0",
          "libdl.so.2", "librt.so.1", "libstdc++.so.6", "libgcc_s.so.1"}
BUNDLED = re.compile(r"(dnnl|openblas|blas|lapack|mimalloc|xxhash|gomp|gfortran|quadmath|OpenCL)")


def elf_files(root):
    for d, _, files in os.walk(root):
        for f in sorted(files):
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                if fh.read(4) == b"\x7fELF":
                    yield p


def main():
    pkg = os.path.dirname(os.path.abspath(kvsieve.__file__))
    site = os.path.dirname(pkg)
    roots = [pkg, os.path.join(site, "kvsieve.libs")]
    errors = []
    files = [p for r in roots if os.path.isdir(r) for p in elf_files(r)]
    if not os.path.isdir(roots[1]):
        errors.append(f"{roots[1]} is missing: the wheel was not repaired (auditwheel)")
    if not any(os.path.basename(p) == "kvsieve" for p in files):
        errors.append(f"the kvsieve command is missing from {pkg}/_bin")
    print(f"check_wheel_deps: {len(files)} ELF files under {site}")
    for p in files:
        out = subprocess.run(["ldd", p], capture_output=True, text=True).stdout
        rel = os.path.relpath(p, site)
        own, system = [], []
        for line in out.splitlines():
            line = line.strip()
            m = re.match(r"(\S+)(?: => (\S+|not found))?", line)
            if not m or line.startswith("statically linked"):
                continue
            name, where = m.group(1), m.group(2) or m.group(1)
            if where == "not found":
                errors.append(f"{rel}: {name} not found")
            elif os.path.realpath(where).startswith(site + os.sep):
                own.append(os.path.relpath(os.path.realpath(where), site))
            elif os.path.basename(name) in SYSTEM:
                system.append(os.path.basename(name))
            else:
                errors.append(f"{rel}: {name} resolves outside the wheel, to {where}")
        print(f"  {rel}\n    from the wheel: {', '.join(own) or '-'}\n    from the system: {', '.join(system)}")

    # Run time: both GEMM libraries, through the package's own session.
    rng = np.random.default_rng(1)
    q = rng.standard_normal((64, 4, 32), dtype=np.float32)
    k = rng.standard_normal((64, 2, 32), dtype=np.float32)
    for gemm in ("onednn", "openblas"):
        with kvsieve.Session(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=32, method="full",
                             gemm=gemm) as s:
            s.prefill(0, q, k, k)
            s.build_index()
            o, _ = s.decode(0, q[0], k[0], k[0])
            assert np.isfinite(o).all()
    with open("/proc/self/maps") as fh:
        mapped = sorted({line.split()[-1] for line in fh if ".so" in line.split()[-1]})
    env_site = os.path.realpath(site)
    for path in mapped:
        if BUNDLED.search(os.path.basename(path)) and not os.path.realpath(path).startswith(env_site + os.sep):
            errors.append(f"run time: {path} is mapped from outside the environment")
    ours = [os.path.relpath(p, site) for p in mapped if p.startswith(site + os.sep)]
    print(f"  run time (oneDNN and OpenBLAS sessions), mapped from the environment: {', '.join(ours)}")

    if errors:
        print("check_wheel_deps: FAILED\n  " + "\n  ".join(errors))
        sys.exit(1)
    print("check_wheel_deps: OK, nothing resolves to the system beyond glibc, libstdc++ and libgcc_s")


if __name__ == "__main__":
    main()
