// SPDX-License-Identifier: Apache-2.0
#include "io/tables.hpp"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <set>
#include <tuple>

#include "core/error.hpp"
#include "io/file_util.hpp"

namespace kvs::io {

using nlohmann::json;

uint64_t checksum64(const void* data, size_t size) { return XXH3_64bits(data, size); }

namespace {

// Preamble field offsets (docs/formats.md, "Tables file").
constexpr uint64_t kOffMagic = 0, kOffMajor = 4, kOffMinor = 6, kOffEndian = 8, kOffFlags = 12,
                   kOffJsonLen = 16, kOffCount = 24, kOffJsonSum = 32, kOffDirSum = 40,
                   kOffPreambleSum = 48;
static_assert(kOffPreambleSum + 8 == kTablesPreambleSize);

uint64_t align_up(uint64_t x) { return (x + kTablesAlignment - 1) / kTablesAlignment * kTablesAlignment; }

uint16_t rd16(const std::byte* p) { return uint16_t(uint16_t(p[0]) | uint16_t(p[1]) << 8); }
uint32_t rd32(const std::byte* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | uint32_t(p[i]);
  return v;
}
uint64_t rd64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | uint64_t(p[i]);
  return v;
}
void wr16(std::byte* p, uint16_t v) {
  for (int i = 0; i < 2; ++i) p[i] = std::byte((v >> (8 * i)) & 0xff);
}
void wr32(std::byte* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = std::byte((v >> (8 * i)) & 0xff);
}
void wr64(std::byte* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = std::byte((v >> (8 * i)) & 0xff);
}

std::string hex64(uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string where(const std::string& path) { return "tables file '" + path + "'"; }

std::string section_name(std::string_view tag, int32_t layer, int32_t head) {
  return "section '" + std::string(tag) + "' (layer " + std::to_string(layer) + ", head " +
         std::to_string(head) + ")";
}

void check_tag(const std::string& tag) {
  if (tag.empty() || tag.size() > kTablesMaxTagLen)
    invalid("section tag '" + tag + "' must have 1 to 32 characters, has " +
            std::to_string(tag.size()));
  for (char c : tag)
    if (c < 0x21 || c > 0x7e)
      invalid("section tag '" + tag + "' must be printable ASCII without spaces");
}

// What parse_layout learned, kept even when it throws part-way (describe_tables reports it).
struct Layout {
  uint16_t major = 0, minor = 0;
  json header;
  bool have_header = false;
  bool have_directory = false;
  uint64_t dir_end = 0;
  std::vector<Section> sections;
};

[[noreturn]] void fmt_fail(kvs_status code, const std::string& path, const std::string& msg) {
  fail(code, where(path) + ": " + msg);
}

// Validates everything except payload checksums and padding.
void parse_layout(const std::byte* b, uint64_t n, const std::string& path, Layout& L) {
  if (n == 0) fmt_fail(KVS_STATUS_FORMAT_TRUNCATED, path, "file is empty, expected at least the 56-byte preamble");
  const uint64_t mlen = std::min<uint64_t>(n, 4);
  if (std::memcmp(b, kTablesMagic, size_t(mlen)) != 0) {
    char got[32];
    std::snprintf(got, sizeof got, "%02x %02x %02x %02x", unsigned(b[0]),
                  n > 1 ? unsigned(b[1]) : 0u, n > 2 ? unsigned(b[2]) : 0u,
                  n > 3 ? unsigned(b[3]) : 0u);
    fmt_fail(KVS_STATUS_FORMAT_MAGIC, path,
             std::string("not a kvsieve tables file: magic bytes are ") + got +
                 ", expected 4b 56 53 56 (\"KVSV\")");
  }
  if (n >= kOffMinor + 2) {
    L.major = rd16(b + kOffMajor);
    L.minor = rd16(b + kOffMinor);
    if (L.major != kTablesMajor)
      fmt_fail(KVS_STATUS_FORMAT_VERSION, path,
               "format version " + std::to_string(L.major) + "." + std::to_string(L.minor) +
                   " is not supported, this library reads format 1.x");
  }
  if (n < kTablesPreambleSize)
    fmt_fail(KVS_STATUS_FORMAT_TRUNCATED, path,
             "preamble: file has " + std::to_string(n) + " bytes, expected at least 56");
  const uint64_t pre_sum = rd64(b + kOffPreambleSum);
  const uint64_t pre_calc = checksum64(b, size_t(kOffPreambleSum));
  if (pre_sum != pre_calc)
    fmt_fail(KVS_STATUS_FORMAT_CHECKSUM, path,
             "header checksum mismatch in the preamble (stored " + hex64(pre_sum) + ", computed " +
                 hex64(pre_calc) + ")");
  const uint32_t endian = rd32(b + kOffEndian);
  if (endian != kTablesEndianMark)
    fmt_fail(KVS_STATUS_FORMAT_INVALID, path,
             "header: endianness mark is " + hex64(endian) + ", expected 0x01020304 (little-endian)");
  (void)kOffFlags;  // reserved: written 0, ignored by 1.x readers (covered by the checksum)

  const uint64_t json_len = rd64(b + kOffJsonLen);
  const uint64_t count = rd64(b + kOffCount);
  if (json_len > n - kTablesPreambleSize)
    fmt_fail(KVS_STATUS_FORMAT_TRUNCATED, path,
             "header: JSON header of " + std::to_string(json_len) +
                 " bytes extends past the end of the file (" + std::to_string(n) + " bytes)");
  const uint64_t json_end = kTablesPreambleSize + json_len;
  if (count > (n - json_end) / kTablesDirEntrySize)
    fmt_fail(KVS_STATUS_FORMAT_TRUNCATED, path,
             "directory: " + std::to_string(count) + " entries of 64 bytes at offset " +
                 std::to_string(json_end) + " extend past the end of the file (" +
                 std::to_string(n) + " bytes)");
  const uint64_t dir_end = json_end + count * kTablesDirEntrySize;
  L.dir_end = dir_end;

  const uint64_t json_sum = rd64(b + kOffJsonSum);
  const uint64_t json_calc = checksum64(b + kTablesPreambleSize, size_t(json_len));
  if (json_sum != json_calc)
    fmt_fail(KVS_STATUS_FORMAT_CHECKSUM, path,
             "header checksum mismatch in the JSON header (stored " + hex64(json_sum) +
                 ", computed " + hex64(json_calc) + ")");
  try {
    L.header = json::parse(reinterpret_cast<const char*>(b + kTablesPreambleSize),
                           reinterpret_cast<const char*>(b + json_end));
  } catch (const json::exception& e) {
    fmt_fail(KVS_STATUS_FORMAT_INVALID, path, std::string("header: invalid JSON: ") + e.what());
  }
  if (!L.header.is_object())
    fmt_fail(KVS_STATUS_FORMAT_INVALID, path, "header: expected a JSON object");
  L.have_header = true;

  const uint64_t dir_sum = rd64(b + kOffDirSum);
  const uint64_t dir_calc = checksum64(b + json_end, size_t(dir_end - json_end));
  if (dir_sum != dir_calc)
    fmt_fail(KVS_STATUS_FORMAT_CHECKSUM, path,
             "directory checksum mismatch (stored " + hex64(dir_sum) + ", computed " +
                 hex64(dir_calc) + ")");

  L.sections.reserve(size_t(count));
  for (uint64_t i = 0; i < count; ++i) {
    const std::byte* e = b + json_end + i * kTablesDirEntrySize;
    const char* t = reinterpret_cast<const char*>(e);
    size_t len = 0;
    while (len < kTablesMaxTagLen && t[len] != '\0') ++len;
    std::string tag(t, len);
    const std::string ent = "directory entry " + std::to_string(i);
    if (len == 0) fmt_fail(KVS_STATUS_FORMAT_INVALID, path, ent + ": empty section tag");
    for (size_t j = 0; j < len; ++j)
      if (t[j] < 0x21 || t[j] > 0x7e)
        fmt_fail(KVS_STATUS_FORMAT_INVALID, path,
                 ent + ": section tag must be printable ASCII, has byte " +
                     std::to_string(unsigned(uint8_t(t[j]))));
    for (size_t j = len; j < kTablesMaxTagLen; ++j)
      if (t[j] != '\0')
        fmt_fail(KVS_STATUS_FORMAT_INVALID, path, ent + ": section tag padding is not NUL");
    Section s;
    s.tag = std::move(tag);
    s.layer = int32_t(rd32(e + 32));
    s.head = int32_t(rd32(e + 36));
    s.offset = rd64(e + 40);
    s.length = rd64(e + 48);
    s.checksum = rd64(e + 56);
    s.data = nullptr;
    L.sections.push_back(std::move(s));
  }
  L.have_directory = true;

  const uint64_t first_payload = align_up(dir_end);
  uint64_t end = dir_end;
  for (auto& s : L.sections) {
    const std::string name = section_name(s.tag, s.layer, s.head);
    if (s.offset % kTablesAlignment != 0)
      fmt_fail(KVS_STATUS_FORMAT_INVALID, path,
               name + ": offset " + std::to_string(s.offset) + " is not a multiple of 64");
    if (s.offset < first_payload)
      fmt_fail(KVS_STATUS_FORMAT_INVALID, path,
               name + ": offset " + std::to_string(s.offset) +
                   " lies inside the header or directory (payloads start at " +
                   std::to_string(first_payload) + ")");
    if (s.offset > n || s.length > n - s.offset)
      fmt_fail(KVS_STATUS_FORMAT_TRUNCATED, path,
               name + ": payload [" + std::to_string(s.offset) + ", " +
                   (s.length > UINT64_MAX - s.offset ? std::string("overflow")
                                                      : std::to_string(s.offset + s.length)) +
                   ") extends past the end of the file (" + std::to_string(n) + " bytes)");
    s.data = b + s.offset;
    end = std::max(end, s.offset + s.length);
  }
  std::vector<size_t> order(L.sections.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::sort(order.begin(), order.end(), [&](size_t a, size_t c) {
    const auto &x = L.sections[a], &y = L.sections[c];
    return std::tie(x.offset, x.length) < std::tie(y.offset, y.length);
  });
  for (size_t i = 1; i < order.size(); ++i) {
    const auto &p = L.sections[order[i - 1]], &c = L.sections[order[i]];
    if (p.offset + p.length > c.offset)
      fmt_fail(KVS_STATUS_FORMAT_INVALID, path,
               section_name(c.tag, c.layer, c.head) + " overlaps " +
                   section_name(p.tag, p.layer, p.head));
  }
  std::set<std::tuple<std::string_view, int32_t, int32_t>> seen;
  for (auto& s : L.sections)
    if (!seen.emplace(s.tag, s.layer, s.head).second)
      fmt_fail(KVS_STATUS_FORMAT_INVALID, path,
               section_name(s.tag, s.layer, s.head) + " appears twice in the directory");
  if (end != n)
    fmt_fail(KVS_STATUS_FORMAT_INVALID, path,
             std::to_string(n - end) + " trailing bytes after the last section (file has " +
                 std::to_string(n) + " bytes, sections end at " + std::to_string(end) + ")");
}

void verify_section(const Section& s, const std::string& path) {
  const uint64_t c = checksum64(s.data, size_t(s.length));
  if (c != s.checksum)
    fmt_fail(KVS_STATUS_FORMAT_CHECKSUM, path,
             section_name(s.tag, s.layer, s.head) + ": checksum mismatch (stored " +
                 hex64(s.checksum) + ", computed " + hex64(c) + ")");
}

// Bytes between the directory and the payloads and between payloads must be zero, so that every
// byte of the file is checked.
void verify_padding(const std::byte* b, const Layout& L, const std::string& path) {
  std::vector<std::pair<uint64_t, uint64_t>> used;
  used.reserve(L.sections.size());
  for (auto& s : L.sections) used.emplace_back(s.offset, s.offset + s.length);
  std::sort(used.begin(), used.end());
  uint64_t cur = L.dir_end;
  auto check = [&](uint64_t from, uint64_t to) {
    for (uint64_t i = from; i < to; ++i)
      if (b[i] != std::byte{0})
        fmt_fail(KVS_STATUS_FORMAT_INVALID, path,
                 "nonzero byte in alignment padding at offset " + std::to_string(i));
  };
  for (auto& [lo, hi] : used) {
    if (lo > cur) check(cur, lo);
    cur = std::max(cur, hi);
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------

TablesWriter::TablesWriter(json header) : header_(std::move(header)) {
  if (!header_.is_object()) invalid("tables header must be a JSON object, got " + std::string(header_.type_name()));
}

void TablesWriter::add(std::string tag, int32_t layer, int32_t head, std::vector<Piece> pieces) {
  check_tag(tag);
  for (auto& s : sections_)
    if (s.tag == tag && s.layer == layer && s.head == head)
      invalid(section_name(tag, layer, head) + " was added twice");
  for (size_t i = 0; i < pieces.size(); ++i)
    if (pieces[i].data == nullptr && pieces[i].size > 0)
      invalid(section_name(tag, layer, head) + ": piece " + std::to_string(i) +
              " has NULL data and size " + std::to_string(pieces[i].size));
  sections_.push_back(Pending{std::move(tag), layer, head, std::move(pieces)});
}

void TablesWriter::add_copy(std::string tag, int32_t layer, int32_t head, const void* data,
                            uint64_t size) {
  if (data == nullptr && size > 0)
    invalid(section_name(tag, layer, head) + ": NULL data with size " + std::to_string(size));
  std::vector<std::byte> buf(static_cast<size_t>(size));
  if (size) std::memcpy(buf.data(), data, size_t(size));
  owned_.reserve(owned_.size() + 1);  // so the push_back below cannot fail after add
  add(std::move(tag), layer, head, {Piece{buf.data(), size}});
  owned_.push_back(std::move(buf));  // moving a vector keeps its heap buffer: the piece stays valid
}

struct TablesWriter::Layout {
  std::byte pre[kTablesPreambleSize] = {};
  std::string js;
  std::vector<std::byte> dir;
  std::vector<uint64_t> offsets;
  uint64_t size = 0;
};

TablesWriter::Layout TablesWriter::layout() const {
  Layout L;
  try {
    L.js = header_.dump();
  } catch (const json::exception& e) {
    invalid(std::string("tables header cannot be serialised: ") + e.what());
  }
  const std::string& js = L.js;
  const uint64_t count = sections_.size();
  const uint64_t json_end = kTablesPreambleSize + js.size();
  const uint64_t dir_end = json_end + count * kTablesDirEntrySize;

  L.dir.assign(size_t(count * kTablesDirEntrySize), std::byte{0});
  uint64_t cur = dir_end;
  L.offsets.resize(sections_.size());
  for (size_t i = 0; i < sections_.size(); ++i) {
    const auto& s = sections_[i];
    uint64_t len = 0;
    XXH3_state_t* st = XXH3_createState();
    if (!st) throw std::bad_alloc();
    XXH3_64bits_reset(st);
    for (auto& p : s.pieces) {
      if (p.size) XXH3_64bits_update(st, p.data, size_t(p.size));
      len += p.size;
    }
    const uint64_t sum = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    const uint64_t off = align_up(cur);
    L.offsets[i] = off;
    std::byte* e = L.dir.data() + i * kTablesDirEntrySize;
    std::memcpy(e, s.tag.data(), s.tag.size());
    wr32(e + 32, uint32_t(s.layer));
    wr32(e + 36, uint32_t(s.head));
    wr64(e + 40, off);
    wr64(e + 48, len);
    wr64(e + 56, sum);
    cur = off + len;
  }
  L.size = cur;

  std::byte* pre = L.pre;
  std::memcpy(pre + kOffMagic, kTablesMagic, 4);
  wr16(pre + kOffMajor, kTablesMajor);
  wr16(pre + kOffMinor, kTablesMinor);
  wr32(pre + kOffEndian, kTablesEndianMark);
  wr32(pre + kOffFlags, 0);
  wr64(pre + kOffJsonLen, js.size());
  wr64(pre + kOffCount, count);
  wr64(pre + kOffJsonSum, checksum64(js.data(), js.size()));
  wr64(pre + kOffDirSum, checksum64(L.dir.data(), L.dir.size()));
  wr64(pre + kOffPreambleSum, checksum64(pre, size_t(kOffPreambleSum)));
  return L;
}

namespace {
// The bytes of a file laid out as L, into any sink with write(data, n), write_zeros(n) and
// position() (a FileSink, or MemorySink below): the one place the file's byte order is written.
template <class Sink, class Sections, class FileLayout>
void emit(Sink& f, const FileLayout& L, const Sections& sections) {
  f.write(L.pre, sizeof L.pre);
  f.write(L.js.data(), L.js.size());
  f.write(L.dir.data(), L.dir.size());
  for (size_t i = 0; i < sections.size(); ++i) {
    f.write_zeros(L.offsets[i] - f.position());
    for (auto& p : sections[i].pieces)
      if (p.size) f.write(p.data, p.size);
  }
}

// A sink into a buffer of known size.
struct MemorySink {
  std::byte* base;
  uint64_t pos = 0;
  void write(const void* d, uint64_t n) {
    if (n) std::memcpy(base + pos, d, size_t(n));
    pos += n;
  }
  void write_zeros(uint64_t n) {
    std::memset(base + pos, 0, size_t(n));
    pos += n;
  }
  uint64_t position() const { return pos; }
};
}  // namespace

void TablesWriter::write_atomic(const std::string& path) {
  const Layout L = layout();
  write_file_atomic(path, [&](FileSink& f) { emit(f, L, sections_); });
}

TablesWriter::Image TablesWriter::write_memory() {
  const Layout L = layout();
  constexpr size_t kAlign = 4096;
  const size_t bytes = (size_t(L.size) + kAlign - 1) / kAlign * kAlign;
  auto* raw = static_cast<std::byte*>(std::aligned_alloc(kAlign, bytes ? bytes : kAlign));
  if (!raw) fail(KVS_STATUS_OUT_OF_MEMORY, "tables image: cannot allocate " + std::to_string(bytes) + " bytes");
  std::shared_ptr<std::byte> buf(raw, [](std::byte* p) { std::free(p); });
  MemorySink sink{raw};
  emit(sink, L, sections_);
  return Image{std::move(buf), L.size};
}

// ------------------------------------------------------------------------------------------------

std::shared_ptr<TablesFile> TablesFile::open(const std::string& path, bool verify_checksums) {
  return from_map(MappedFile::open(path), verify_checksums);
}

std::shared_ptr<TablesFile> TablesFile::open_memory(const TablesWriter::Image& image, const std::string& name,
                                                    bool verify_checksums) {
  return from_map(MappedFile::wrap(image.data, image.data.get(), image.size, name), verify_checksums);
}

std::shared_ptr<TablesFile> TablesFile::from_map(std::shared_ptr<MappedFile> map, bool verify_checksums) {
  const std::string& name = map->path();
  Layout L;
  parse_layout(map->data(), map->size(), name, L);
  if (verify_checksums) {
    for (auto& s : L.sections) verify_section(s, name);
    verify_padding(map->data(), L, name);
  }
  std::shared_ptr<TablesFile> f(new TablesFile());
  f->map_ = std::move(map);
  f->header_ = std::move(L.header);
  f->sections_ = std::move(L.sections);
  f->major_ = L.major;
  f->minor_ = L.minor;
  return f;
}

const Section* TablesFile::find(std::string_view tag, int32_t layer, int32_t head) const {
  for (auto& s : sections_)
    if (s.layer == layer && s.head == head && s.tag == tag) return &s;
  return nullptr;
}

const Section& TablesFile::require(std::string_view tag, int32_t layer, int32_t head) const {
  if (auto* s = find(tag, layer, head)) return *s;
  fmt_fail(KVS_STATUS_FORMAT_INVALID, map_->path(),
           section_name(tag, layer, head) + " is missing");
}

std::string TablesFile::path() const { return map_->path(); }
uint64_t TablesFile::file_size() const { return map_->size(); }

// ------------------------------------------------------------------------------------------------

json describe_tables(const std::string& path) {
  auto map = MappedFile::open(path);
  const std::byte* b = map->data();
  const uint64_t n = map->size();
  Layout L;
  json out;
  out["path"] = path;
  out["file_size"] = n;
  out["ok"] = true;
  out["error"] = nullptr;
  out["error_code"] = int(KVS_STATUS_OK);
  auto set_error = [&](const Error& e) {
    if (!out["ok"].get<bool>()) return;  // keep the first error
    out["ok"] = false;
    out["error"] = e.what();
    out["error_code"] = int(e.code());
  };
  bool structure_ok = false;
  try {
    parse_layout(b, n, path, L);
    structure_ok = true;
  } catch (const Error& e) {
    set_error(e);
  }
  if (L.major != 0) out["format_version"] = std::to_string(L.major) + "." + std::to_string(L.minor);
  out["header"] = L.have_header ? L.header : json(nullptr);
  json secs = json::array();
  json by_tag = json::object();
  for (auto& s : L.sections) {
    json j;
    j["tag"] = s.tag;
    j["layer"] = s.layer;
    j["head"] = s.head;
    j["offset"] = s.offset;
    j["length"] = s.length;
    j["checksum"] = hex64(s.checksum).substr(2);
    const bool in_range = s.offset <= n && s.length <= n - s.offset;
    if (!in_range) {
      j["status"] = "out_of_range";
    } else {
      const uint64_t c = checksum64(b + s.offset, size_t(s.length));
      j["status"] = c == s.checksum ? "ok" : "mismatch";
      if (c != s.checksum) {
        try {
          Section t = s;
          t.data = b + s.offset;
          verify_section(t, path);
        } catch (const Error& e) {
          set_error(e);
        }
      }
    }
    by_tag[s.tag] = by_tag.value(s.tag, uint64_t(0)) + s.length;
    secs.push_back(std::move(j));
  }
  if (structure_ok) {
    try {
      verify_padding(b, L, path);
    } catch (const Error& e) {
      set_error(e);
    }
  }
  out["sections"] = std::move(secs);
  out["bytes_by_tag"] = std::move(by_tag);
  return out;
}

}  // namespace kvs::io
