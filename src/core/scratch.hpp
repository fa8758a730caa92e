// SPDX-License-Identifier: Apache-2.0
// Per-step scratch held by a method's state but not copied with it: a copy (a fork, an append's
// undo snapshot) starts with an empty value instead of copying megabytes per layer.
#pragma once

namespace kvs {

template <class T>
struct Scratch {
  T v{};
  Scratch() = default;
  Scratch(const Scratch&) {}
  Scratch& operator=(const Scratch&) { return *this; }
  Scratch(Scratch&&) = default;
  Scratch& operator=(Scratch&&) = default;
};

}  // namespace kvs
