// SPDX-License-Identifier: Apache-2.0
// Files: read-only memory maps and atomic writes (temporary file in the target's directory, write,
// fsync, rename, fsync the directory), so a reader never sees a half-written file and a failed
// write never damages an existing one.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace kvs::io {

// A whole file mapped read-only (MAP_PRIVATE). An empty file has data() == nullptr, size() == 0.
class MappedFile {
 public:
  // Throws KVS_STATUS_IO (errno as backend code) naming the path.
  static std::shared_ptr<MappedFile> open(const std::string& path);
  // Bytes already in memory, kept alive by `owner`; `name` stands for the path in messages.
  static std::shared_ptr<MappedFile> wrap(std::shared_ptr<const void> owner, const std::byte* data, uint64_t size,
                                          std::string name);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  std::string path_;
  const std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  std::shared_ptr<const void> owner_;  // set: wrapped memory (not a mapping)
};

// Sequential writer handed to the body of write_file_atomic. Every failure throws KVS_STATUS_IO.
class FileSink {
 public:
  void write(const void* data, uint64_t size);
  void write_zeros(uint64_t size);
  uint64_t position() const { return pos_; }

 private:
  friend void write_file_atomic(const std::string&, const std::function<void(FileSink&)>&);
  FileSink(int fd, std::string tmp_path) : fd_(fd), tmp_path_(std::move(tmp_path)) {}
  int fd_;
  std::string tmp_path_;
  uint64_t pos_ = 0;
};

// Creates a temporary file next to `path` (".NAME.tmp.PID.N.R", locked with flock while it is
// written), lets `body` fill it, fsyncs it, renames it over `path` and fsyncs the directory. On any
// failure (including an exception from body) the temporary file is removed, an existing `path` is
// left untouched, and the error is rethrown (KVS_STATUS_IO with errno as backend code for system
// failures). A process killed mid-write leaves its temporary file: the next write to the same path
// removes it first (remove_stale_temporaries).
void write_file_atomic(const std::string& path, const std::function<void(FileSink&)>& body);

// An unlocked temporary file of a writer whose PID is alive is kept for this long (the PID may have
// been reused by another process after a kill; or the writer is between creating and locking it).
constexpr int64_t kStaleTemporarySeconds = 3600;

// Removes the temporary files that writes to `path` left behind: those named as write_file_atomic
// names them for exactly this path, regular files, not locked by a writer, and either named with
// the PID of no live process (not this one) or last modified more than max_age_seconds ago.
// Never fails (a file that cannot be inspected or removed is left).
void remove_stale_temporaries(const std::string& path, int64_t max_age_seconds);

}  // namespace kvs::io
