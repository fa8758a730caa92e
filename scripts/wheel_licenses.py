#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Adds the licence texts of the libraries `auditwheel repair` bundled to a repaired wheel.

    scripts/wheel_licenses.py REPAIRED_WHEEL RAW_WHEEL

Each file of the repaired wheel's kvsieve.libs/ (``libdnnl-1a2b3c4d.so.2``: auditwheel's hashed
copy of ``libdnnl.so.2``) is traced back to the system file it was copied from (``ldd`` on the ELF
files of RAW_WHEEL, the wheel before repair), that file to its Debian package (``dpkg -S``) and the
package to its ``/usr/share/doc/<package>/copyright``. The copyright files, the texts of
``/usr/share/common-licenses`` they refer to, and an index (``bundled/README``: which library came
from which package at which version) go into ``kvsieve-<version>.dist-info/licenses/bundled/``, beside
LICENSE and NOTICE (METADATA, core metadata 2.2 from scikit-build-core, lists no licence files; it is
left as it is); RECORD is rewritten. A bundled library whose package
or copyright file cannot be found is an error (exit status 1): the wheel must not ship without it.
"""
import base64
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile

# auditwheel's copy of libopenblasp-r0.3.21.so: libopenblasp-r0-<8 hex>.3.21.so (the hash before the first dot)
HASHED = re.compile(r"^(?P<base>[^.]+)-[0-9a-f]{8}\.(?P<ext>.+)$")
COMMON = re.compile(r"/usr/share/common-licenses/([A-Za-z0-9+.-]*[A-Za-z0-9+-])")
# Licences a copyright file quotes by their notice but names only by a generic path ("LGPL", today
# the LGPL-3): gcc-<N>-base's libquadmath parts are LGPL-2.1-or-later and LGPL-2-or-later.
NOTICES = [(re.compile(r"Lesser General Public\s+License as published by the Free Software\s+Foundation; "
                       r"either\s+version 2\.1"), "LGPL-2.1"),
           (re.compile(r"GNU Library General Public\s+License as published"), "LGPL-2")]


def fail(msg):
    sys.exit(f"wheel_licenses: {msg}")


def system_libraries(raw_wheel):
    """soname -> resolved path, over every ELF file of the unrepaired wheel (ldd: transitively)."""
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(raw_wheel) as z:
            z.extractall(tmp)
        for root, _, files in os.walk(tmp):
            for f in files:
                path = os.path.join(root, f)
                with open(path, "rb") as fh:
                    if fh.read(4) != b"\x7fELF":
                        continue
                out = subprocess.run(["ldd", path], check=True, capture_output=True, text=True).stdout
                for line in out.splitlines():
                    m = re.match(r"\s*(\S+) => (/\S+)", line)
                    if m and not m.group(2).startswith(tmp):
                        found[m.group(1)] = m.group(2)
    return found


def debian_package(path):
    """(package, version) owning path; dpkg knows usrmerged files under either /lib or /usr/lib."""
    candidates = [os.path.realpath(path), path]
    for p in list(candidates):
        if p.startswith("/usr/lib/"):
            candidates.append(p[len("/usr"):])
    for p in candidates:
        r = subprocess.run(["dpkg", "-S", p], capture_output=True, text=True)
        if r.returncode == 0:
            pkg = r.stdout.split(":", 1)[0].split(",")[0].strip()
            version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], check=True,
                                     capture_output=True, text=True).stdout
            return pkg, version
    fail(f"no Debian package owns {path}")


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def main():
    if len(sys.argv) != 3:
        fail("usage: wheel_licenses.py REPAIRED_WHEEL RAW_WHEEL")
    wheel, raw = sys.argv[1:]
    libs = system_libraries(raw)
    # auditwheel names a copy after the file's soname or after its real name (libOpenCL.so.1.0.0)
    by_name = {os.path.basename(os.path.realpath(p)): p for p in libs.values()}

    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
        contents = {i.filename: z.read(i.filename) for i in infos}
    dist_info = next(n.split("/")[0] for n in contents if n.split("/")[0].endswith(".dist-info"))
    bundled = sorted(n for n in contents if n.startswith("kvsieve.libs/") and not n.endswith("/"))
    if not bundled:
        fail(f"{wheel} bundles no library (kvsieve.libs/ is empty): not a repaired wheel?")

    dest = f"{dist_info}/licenses/bundled"
    added = {}  # archive name -> bytes
    index = ["Libraries bundled in kvsieve.libs/ by auditwheel, the Debian packages they were copied",
             "from, and the licence file of each (copied from /usr/share/doc/<package>/copyright; the",
             "texts under common-licenses/ are those the copyright files refer to).", ""]
    for name in bundled:
        f = name.split("/", 1)[1]
        m = HASHED.match(f)
        if not m:
            fail(f"{name}: not an auditwheel-hashed name")
        soname = m.group("base") + "." + m.group("ext")
        src = libs.get(soname) or by_name.get(soname)
        if not src:
            fail(f"{name}: {soname} is not among the libraries the unrepaired wheel loads")
        pkg, version = debian_package(src)
        doc = os.path.realpath(f"/usr/share/doc/{pkg}")  # the GCC runtimes share gcc-<N>-base's
        copyright = os.path.join(doc, "copyright")
        if not os.path.isfile(copyright):
            fail(f"{name}: {copyright} (licence of {pkg}) is missing")
        with open(copyright, "rb") as fh:
            text = fh.read()
        lic = f"{os.path.basename(doc)}.copyright"
        added[f"{dest}/{lic}"] = text
        utext = text.decode("utf-8", "replace")
        names = set(COMMON.findall(utext)) | {name for rx, name in NOTICES if rx.search(utext)}
        for common in sorted(names):
            cpath = f"/usr/share/common-licenses/{common}"
            if os.path.isfile(cpath):
                with open(cpath, "rb") as fh:
                    added[f"{dest}/common-licenses/{common}"] = fh.read()
        index.append(f"{f}  ({soname}): Debian {pkg} {version}; licence: {lic}")
    added[f"{dest}/README"] = ("\n".join(index) + "\n").encode()

    record_name = f"{dist_info}/RECORD"
    tmp = wheel + ".tmp"
    records = []
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for info in infos:
            if info.filename == record_name or info.filename in added:  # (a second run replaces)
                continue
            out.writestr(info, contents[info.filename], compress_type=zipfile.ZIP_DEFLATED)
            if not info.filename.endswith("/"):
                records.append(record_line(info.filename, contents[info.filename]))
        for name in sorted(added):
            info = zipfile.ZipInfo(name, date_time=infos[0].date_time)
            info.external_attr = 0o644 << 16
            out.writestr(info, added[name], compress_type=zipfile.ZIP_DEFLATED)
            records.append(record_line(name, added[name]))
        records.append(f"{record_name},,")
        out.writestr(zipfile.ZipInfo(record_name, date_time=infos[0].date_time), "\n".join(records) + "\n",
                     compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, wheel)
    print(f"wheel_licenses: {len(bundled)} bundled libraries, {len(added)} licence files in {dest}/")
    print("\n".join(index[4:]))


if __name__ == "__main__":
    main()
