# SPDX-License-Identifier: Apache-2.0
"""The ``kvsieve`` console script of the wheel: it replaces itself with the C++ command shipped in
the package (``kvsieve/_bin/kvsieve``, which finds ``libkvsieve.so.0`` one folder up and the
bundled libraries through its RPATH), so arguments, output and exit status are the command's own.
"""

from __future__ import annotations

import os
import sys


def executable() -> str:
    """The path of the packaged ``kvsieve`` command (it exists in wheels built from source)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", "kvsieve")


def main() -> None:
    exe = executable()
    if not os.access(exe, os.X_OK):
        # A package built with KVS_PYTHON_USE_INSTALLED=ON, or the in-tree one, has no command.
        sys.exit(f"kvsieve: this installation of the Python package has no kvsieve command ({exe} "
                 "is missing); build the wheel from source, or use the kvsieve of a CMake install")
    os.execv(exe, ["kvsieve", *sys.argv[1:]])


if __name__ == "__main__":
    main()
