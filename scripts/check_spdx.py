#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks that every source file of kvsieve carries an SPDX-License-Identifier line.

    scripts/check_spdx.py [--root DIR] [--fix] [FILE...]

Without FILE arguments it checks the files git tracks under the source folders (src, include, cli,
bindings, tests, bench, examples, scripts, tools, cmake, .ci) and the top-level CMakeLists.txt,
keeping those of the languages we write: C, C++, CUDA, SWIG, Python, Java, Go, Rust, CMake, shell.
The line must be among the first five lines of a file (after a shebang or an encoding line).
Exit status: 0 when every file has it, 1 when some lack it (each is named), 2 on a usage error.
--fix inserts "SPDX-License-Identifier: Apache-2.0" as a comment where it is missing.
"""
import argparse
import os
import subprocess
import sys

LICENSE = "Apache-2.0"
TAG = "SPDX-License-Identifier:"
DIRS = ["src", "include", "cli", "bindings", "tests", "bench", "examples", "scripts", "tools",
        "cmake", ".ci"]
TOP_FILES = ["CMakeLists.txt"]
# Comment syntax by file-name ending; files without an ending are checked when they start with a
# shell shebang (.ci/run).
C89 = {".c", ".h"}  # the public header stays valid C89: /* */ comments
SLASH = {".cpp", ".hpp", ".cc", ".cu", ".cuh", ".inc", ".i", ".java", ".go", ".rs"}
HASH = {".py", ".pyi", ".sh", ".cmake"}
# Files whose headers are added by a branch that edits them (remove an entry once it has the line).
PENDING = ()


def comment_style(path):
    name = os.path.basename(path)
    ext = os.path.splitext(name)[1]
    if name == "CMakeLists.txt" or name.endswith(".cmake.in"):
        return "#"
    if ext in C89:
        return "/*"
    if ext in SLASH:
        return "//"
    if ext in HASH:
        return "#"
    if ext == "":
        try:
            with open(path, "rb") as f:
                first = f.readline()
        except OSError:
            return None
        if first.startswith(b"#!") and (b"sh" in first or b"python" in first):
            return "#"
    return None


def tracked_files(root):
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--", *DIRS, *TOP_FILES],
                             check=True, capture_output=True).stdout
        return [p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        # Not a git checkout (a source archive): walk the folders instead.
        files = [f for f in TOP_FILES if os.path.exists(os.path.join(root, f))]
        for d in DIRS:
            for dirpath, dirnames, filenames in os.walk(os.path.join(root, d)):
                dirnames[:] = [x for x in dirnames if not x.startswith(("build", "target"))]
                files += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames]
        return files


def has_tag(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        head = [f.readline() for _ in range(5)]
    return any(TAG in line for line in head)


def add_tag(path, style):
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    at = 0
    while at < len(lines) and at < 2 and (lines[at].startswith("#!") or "coding" in lines[at][:30]):
        at += 1
    end = " */" if style == "/*" else ""
    # A Go comment right above the package clause would become the package's documentation.
    sep = "\n" if path.endswith(".go") else ""
    lines.insert(at, f"{style} {TAG} {LICENSE}{end}\n{sep}")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                    help="repository root (default: the one this script is in)")
    ap.add_argument("--fix", action="store_true", help="add the line where it is missing")
    ap.add_argument("files", nargs="*", help="check only these files (paths relative to --root)")
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    if not os.path.isdir(root):
        print(f"check_spdx: --root {a.root}: not a directory", file=sys.stderr)
        return 2
    files = a.files or tracked_files(root)
    checked, missing = 0, []
    for rel in files:
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            if a.files:
                print(f"check_spdx: {rel}: no such file", file=sys.stderr)
                return 2
            continue
        style = comment_style(path)
        if style is None:
            continue
        checked += 1
        if has_tag(path):
            continue
        if a.fix and not rel.startswith(PENDING):
            add_tag(path, style)
            continue
        missing.append(rel)
    pending = [m for m in missing if PENDING and m.startswith(PENDING)]
    missing = [m for m in missing if m not in pending]
    for m in missing:
        print(f"{m}: no '{TAG}' line in its first 5 lines", file=sys.stderr)
    if pending:
        print(f"check_spdx: {len(pending)} file(s) under {', '.join(PENDING)} still to be given the line",
              file=sys.stderr)
    if missing:
        print(f"check_spdx: {len(missing)} of {checked} source files lack the SPDX line "
              f"(scripts/check_spdx.py --fix adds it)", file=sys.stderr)
        return 1
    print(f"check_spdx: {checked} source files, all with an SPDX-License-Identifier line")
    return 0


if __name__ == "__main__":
    sys.exit(main())
