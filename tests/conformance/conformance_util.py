# SPDX-License-Identifier: Apache-2.0
"""Shared helpers of the conformance tests: float64 attention and a reader of kvsieve tables files.

The tables reader follows docs/formats.md ("Tables file, format 1.0"): a 56-byte preamble, the JSON
header, a directory of 64-byte entries (tag, layer, head, offset, length, checksum), payloads.
"""

import json
import struct

import numpy as np


def attend(q, K, V, scale):
    """float64 attention of one query q [d] over K, V [m, d] -> (o [d], lse)."""
    s = scale * (K @ q)
    m = s.max()
    p = np.exp(s - m)
    z = p.sum()
    return p @ V / z, m + np.log(z)


def merge(o1, l1, o2, l2):
    """Merges two attention states by their log-sum-exp (flash-decoding's combine)."""
    lse = np.logaddexp(l1, l2)
    return np.exp(l1 - lse) * o1 + np.exp(l2 - lse) * o2, lse


class Tables:
    """The header and sections of a tables file written by Session.save."""

    def __init__(self, path):
        raw = open(path, "rb").read()
        if raw[:4] != b"KVSV":
            raise ValueError(f"{path}: not a kvsieve tables file")
        hlen, nsec = struct.unpack_from("<QQ", raw, 16)
        self.header = json.loads(raw[56:56 + hlen].decode())
        self.sections = {}
        at = 56 + hlen
        for i in range(nsec):
            tag, layer, head, off, length, _ = struct.unpack_from("<32siiQQQ", raw, at + 64 * i)
            self.sections[(tag.rstrip(b"\0").decode(), layer, head)] = raw[off:off + length]

    def array(self, tag, layer, head, dtype, shape=None):
        a = np.frombuffer(self.sections[(tag, layer, head)], dtype=dtype)
        return a.reshape(shape) if shape is not None else a

    @property
    def params(self):
        return self.header["method"]["params"]

    @property
    def meta(self):
        return self.header["method"]["meta"]
