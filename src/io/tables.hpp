// SPDX-License-Identifier: Apache-2.0
// The tables file container (format 1.0, byte layout in docs/formats.md), after GGUF: a fixed
// preamble (magic, version, endianness mark, sizes, checksums), a JSON header, a section directory,
// then payloads aligned to 64 bytes so a loader can use them straight from a read-only mmap.
// Every byte of the preamble, header and directory and every payload is covered by an XXH3-64
// checksum; padding must be zero.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace kvs::io {

inline constexpr char kTablesMagic[4] = {'K', 'V', 'S', 'V'};
inline constexpr uint16_t kTablesMajor = 1;
inline constexpr uint16_t kTablesMinor = 0;
inline constexpr uint32_t kTablesEndianMark = 0x01020304u;
inline constexpr uint64_t kTablesPreambleSize = 56;
inline constexpr uint64_t kTablesDirEntrySize = 64;
inline constexpr uint64_t kTablesAlignment = 64;
inline constexpr size_t kTablesMaxTagLen = 32;  // printable ASCII, NUL-padded in the directory

// A borrowed byte range.
struct Piece {
  const void* data;
  uint64_t size;
};

class TablesWriter {
 public:
  // header must be a JSON object; it is stored exactly as given (dumped compactly).
  explicit TablesWriter(nlohmann::json header);

  // Borrowed: pieces must stay valid until write_atomic returns. A section may be several
  // scattered pieces, written back to back, so large KV pages are never copied.
  // tag: 1..32 printable ASCII characters; (tag, layer, head) must be unique. layer/head: any
  // int32, -1 by convention for "not per layer/head". Throws KVS_STATUS_INVALID_ARGUMENT.
  void add(std::string tag, int32_t layer, int32_t head, std::vector<Piece> pieces);
  // Small data, copied now.
  void add_copy(std::string tag, int32_t layer, int32_t head, const void* data, uint64_t size);

  // Temporary file in the same directory, write, fsync, rename, fsync the directory. On failure
  // removes the temporary file, leaves an existing file intact, throws KVS_STATUS_IO with errno
  // as backend code.
  void write_atomic(const std::string& path);
  // The same bytes in memory (4096-byte aligned, so sections keep their alignment): the form in
  // which a session's state moves between placements (Session::to).
  struct Image {
    std::shared_ptr<const std::byte> data;
    uint64_t size = 0;
  };
  Image write_memory();

  size_t section_count() const { return sections_.size(); }

 private:
  // Lays the file out: the preamble, header and directory bytes, each section's offset, the size.
  struct Layout;
  Layout layout() const;
  struct Pending {
    std::string tag;
    int32_t layer, head;
    std::vector<Piece> pieces;
  };
  nlohmann::json header_;
  std::vector<Pending> sections_;
  std::vector<std::vector<std::byte>> owned_;
};

struct Section {
  std::string tag;
  int32_t layer;
  int32_t head;
  uint64_t offset, length, checksum;
  const std::byte* data;  // into the mapping; 64-byte aligned
};

class MappedFile;

// Read-only mmap of the whole file, kept alive by the shared_ptr (section data pointers stay valid
// as long as it lives). @threadsafety concurrent-const
class TablesFile {
 public:
  // Validates the whole structure; with verify_checksums also every payload checksum and that
  // all padding is zero. Throws FORMAT_MAGIC / FORMAT_VERSION / FORMAT_TRUNCATED /
  // FORMAT_CHECKSUM / FORMAT_INVALID naming the path and the part, or KVS_STATUS_IO.
  static std::shared_ptr<TablesFile> open(const std::string& path, bool verify_checksums = true);
  // An image from TablesWriter::write_memory (structure validated; checksums only when asked: the
  // bytes were just written by this process). `name` stands for the path in messages.
  static std::shared_ptr<TablesFile> open_memory(const TablesWriter::Image& image, const std::string& name,
                                                 bool verify_checksums = false);

  const nlohmann::json& header() const { return header_; }
  const std::vector<Section>& sections() const { return sections_; }
  const Section* find(std::string_view tag, int32_t layer, int32_t head) const;
  // Throws KVS_STATUS_FORMAT_INVALID naming the file and the section.
  const Section& require(std::string_view tag, int32_t layer, int32_t head) const;
  std::string path() const;
  uint64_t file_size() const;
  uint16_t format_major() const { return major_; }
  uint16_t format_minor() const { return minor_; }

 private:
  TablesFile() = default;
  static std::shared_ptr<TablesFile> from_map(std::shared_ptr<MappedFile> map, bool verify_checksums);
  std::shared_ptr<MappedFile> map_;
  nlohmann::json header_;
  std::vector<Section> sections_;
  uint16_t major_ = 0, minor_ = 0;
};

// Checks every section and returns a JSON description for `kvsieve inspect`:
//   {"path", "file_size", "format_version", "header", "sections": [{"tag","layer","head","offset",
//    "length","checksum" (16 hex digits),"status": "ok"|"mismatch"|"unchecked"}],
//    "bytes_by_tag": {tag: bytes}, "ok": bool, "error": string|null, "error_code": kvs_status}
// Corruption anywhere is reported inside the JSON, not thrown; only a file that cannot be opened
// or mapped throws (KVS_STATUS_IO).
nlohmann::json describe_tables(const std::string& path);

// XXH3-64 with seed 0 (the checksum of every part of the file).
uint64_t checksum64(const void* data, size_t size);

}  // namespace kvs::io
