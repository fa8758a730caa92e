// SPDX-License-Identifier: Apache-2.0
// A host memory read-bandwidth probe, so `kvsieve bench` can put its decode times beside the
// machine's own floor (the floor is bytes over measured DRAM bandwidth; docs/perf.md).
#pragma once

#include <cstddef>

namespace kvcli {

// Default probe size: 4x the last-level cache, clamped to [256 MiB, 2 GiB] and to 1/8 of RAM.
size_t default_bandwidth_bytes();

// Best of `reps` timed passes of `threads` threads summing disjoint slices of a `bytes` buffer
// (first touched by the same threads); returns 1e9 bytes per second.
double measure_read_bandwidth(size_t bytes, unsigned threads, int reps);

}  // namespace kvcli
