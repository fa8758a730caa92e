// SPDX-License-Identifier: Apache-2.0
// Tables container (src/io/tables.*): round trips, truncation, every bit flip, versioning, atomic
// writes, describe, and the v1.0 golden file.
#include <dirent.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "io/tables.hpp"
#include "kvsieve/kvsieve.h"

using kvs::io::Piece;
using kvs::io::TablesFile;
using kvs::io::TablesWriter;
using nlohmann::json;

namespace {

struct TempDir {
  std::string path;
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/kvs_tables_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    REQUIRE(::mkdtemp(buf.data()) != nullptr);
    path = buf.data();
  }
  ~TempDir() { (void)std::system(("rm -rf '" + path + "'").c_str()); }
  std::string file(const std::string& name) const { return path + "/" + name; }
  std::vector<std::string> entries() const {
    std::vector<std::string> r;
    if (DIR* d = ::opendir(path.c_str())) {
      while (dirent* e = ::readdir(d))
        if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) r.push_back(e->d_name);
      ::closedir(d);
    }
    return r;
  }
};

std::vector<std::byte> random_bytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> v(n);
  for (auto& b : v) b = std::byte(1 + rng() % 255);  // never zero
  return v;
}

std::vector<uint8_t> read_all(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}
void write_all(const std::string& p, const std::vector<uint8_t>& d) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(d.data()), std::streamsize(d.size()));
}

// The code of the kvs::Error that f throws (KVS_STATUS_OK if none); the message goes to *msg.
template <class F>
kvs_status code_of(F&& f, std::string* msg = nullptr) {
  try {
    f();
  } catch (const kvs::Error& e) {
    if (msg) *msg = e.what();
    return e.code();
  }
  return KVS_STATUS_OK;
}

kvs_status open_code(const std::string& p, std::string* msg = nullptr) {
  return code_of([&] { TablesFile::open(p); }, msg);
}

uint64_t rd64(const std::vector<uint8_t>& d, size_t off) {
  uint64_t v;
  std::memcpy(&v, d.data() + off, 8);
  return v;
}
void wr64(std::vector<uint8_t>& d, size_t off, uint64_t v) { std::memcpy(d.data() + off, &v, 8); }

// Recomputes the three structure checksums after a deliberate edit, so tests reach the checks
// behind them.
void reseal(std::vector<uint8_t>& d) {
  const uint64_t jl = rd64(d, 16), n = rd64(d, 24);
  wr64(d, 32, kvs::io::checksum64(d.data() + 56, jl));
  wr64(d, 40, kvs::io::checksum64(d.data() + 56 + jl, n * 64));
  wr64(d, 48, kvs::io::checksum64(d.data(), 48));
}
size_t dir_entry(const std::vector<uint8_t>& d, size_t i) { return 56 + rd64(d, 16) + i * 64; }

// A small file with three sections: sizes 5, 70 and 1; returns the path.
std::string small_file(const TempDir& td, std::mt19937_64& rng) {
  TablesWriter w(json{{"method", "test"}, {"n", 3}});
  auto a = random_bytes(rng, 5), b = random_bytes(rng, 70), c = random_bytes(rng, 1);
  w.add_copy("alpha", 0, 0, a.data(), a.size());
  w.add_copy("beta", 0, 1, b.data(), b.size());
  w.add_copy("gamma", -1, -1, c.data(), c.size());
  const std::string p = td.file("small.kvs");
  w.write_atomic(p);
  return p;
}

std::string golden_dir() {
#ifdef KVS_TEST_DATA_DIR
  return std::string(KVS_TEST_DATA_DIR) + "/golden";
#else
  if (const char* e = std::getenv("KVS_TEST_DATA_DIR")) return std::string(e) + "/golden";
  for (const char* c : {"tests/data", "../tests/data", "../../tests/data", "../../../tests/data"}) {
    struct stat st;
    if (::stat((std::string(c) + "/golden").c_str(), &st) == 0) return std::string(c) + "/golden";
  }
  return "tests/data/golden";
#endif
}

// The golden v1.0 content (docs/formats.md, "Golden files"): integer formulas only, so it is the
// same on every platform. Used to regenerate the file and to check it.
struct Golden {
  json header = {{"format", "kvsieve-tables"},
                 {"generator", "tests/unit/test_tables.cpp golden v1.0"},
                 {"model", {{"num_layers", 2}, {"num_q_heads", 4}, {"num_kv_heads", 2}, {"head_dim", 8}}},
                 {"method", "golden"},
                 {"params", {{"clusters", 16}, {"budget", 0.125}, {"name", "g\u00e9"}}},
                 {"kv_included", false}};
  std::vector<float> centroids[2];
  std::vector<int32_t> ids;
  std::vector<uint8_t> blob;
  std::string note = "kvsieve golden tables file, format 1.0";
  Golden() {
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 16 * 8; ++i) centroids[h].push_back(float((i * 37 + h * 11) % 101 - 50) / 8.f);
    for (int i = 0; i < 37; ++i) ids.push_back(int32_t(i * i * 7919 % 1009) - 500);
    uint32_t x = 12345;
    for (int i = 0; i < 300; ++i) {
      x = x * 1103515245u + 12345u;
      blob.push_back(uint8_t(x >> 24));
    }
  }
  void write(const std::string& path) const {
    TablesWriter w(header);
    w.add_copy("note", -1, -1, note.data(), note.size());
    w.add("centroids", 0, 0, {Piece{centroids[0].data(), centroids[0].size() * 4}});
    w.add("centroids", 0, 1, {Piece{centroids[1].data(), 64 * 4}, Piece{centroids[1].data() + 64, 64 * 4}});
    w.add("ids", 1, 0, {Piece{ids.data(), ids.size() * 4}});
    w.add("empty", 1, 1, {});
    w.add("blob", 1, -1, {Piece{blob.data(), blob.size()}});
    w.write_atomic(path);
  }
};

}  // namespace

TEST_CASE("tables: round trip of scattered pieces, 64-byte alignment, find/require") {
  TempDir td;
  std::mt19937_64 rng(42);
  json header = {{"method", "csattention"}, {"params", {{"k", 16}, {"alpha", 0.25}}}, {"kv", true}};
  TablesWriter w(header);
  struct Want {
    std::string tag;
    int32_t layer, head;
    std::vector<std::byte> bytes;
  };
  std::vector<Want> want;
  std::vector<std::vector<std::byte>> keep;  // borrowed pieces live until write_atomic returns
  const size_t sizes[] = {0, 1, 63, 64, 65, 1000, 4097};
  int i = 0;
  for (size_t sz : sizes) {
    // Split each section into up to three scattered pieces from separate buffers.
    std::vector<Piece> pieces;
    std::vector<std::byte> all;
    size_t left = sz;
    for (int p = 0; p < 3 && (left > 0 || p == 0); ++p) {
      size_t n = p == 2 ? left : std::min(left, size_t(rng() % (sz + 1)));
      keep.push_back(random_bytes(rng, n));
      pieces.push_back(Piece{keep.back().data(), n});
      all.insert(all.end(), keep.back().begin(), keep.back().end());
      left -= n;
    }
    want.push_back({"sec" + std::to_string(i), i % 3, i - 2, all});
    w.add(want.back().tag, want.back().layer, want.back().head, pieces);
    ++i;
  }
  auto small = random_bytes(rng, 33);
  w.add_copy("copied", 7, 7, small.data(), small.size());
  want.push_back({"copied", 7, 7, small});
  small.assign(small.size(), std::byte{0});  // the writer copied it

  const std::string p = td.file("t.kvs");
  w.write_atomic(p);
  CHECK(td.entries() == std::vector<std::string>{"t.kvs"});  // no temporary file left

  auto f = TablesFile::open(p);
  CHECK(f->header() == header);
  CHECK(f->path() == p);
  CHECK(f->file_size() == read_all(p).size());
  CHECK(f->format_major() == 1);
  CHECK(f->format_minor() == 0);
  REQUIRE(f->sections().size() == want.size());
  for (auto& wv : want) {
    const auto* s = f->find(wv.tag, wv.layer, wv.head);
    REQUIRE(s != nullptr);
    CHECK(s->length == wv.bytes.size());
    CHECK(s->offset % 64 == 0);
    CHECK(reinterpret_cast<uintptr_t>(s->data) % 64 == 0);
    if (!wv.bytes.empty()) CHECK(std::memcmp(s->data, wv.bytes.data(), wv.bytes.size()) == 0);
    CHECK(&f->require(wv.tag, wv.layer, wv.head) == s);
  }
  CHECK(f->find("sec0", 0, 0) == nullptr);  // head differs
  std::string msg;
  CHECK(code_of([&] { f->require("missing", 3, 4); }, &msg) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("'missing' (layer 3, head 4)") != std::string::npos);
  CHECK(msg.find(p) != std::string::npos);

  // Sections survive the TablesFile handle as long as the shared_ptr lives.
  const std::byte* d = f->sections()[1].data;
  auto f2 = f;
  f.reset();
  CHECK(d[0] == want[1].bytes[0]);
}

TEST_CASE("tables: writer rejects bad input") {
  CHECK(code_of([] { TablesWriter w(json::array()); }) == KVS_STATUS_INVALID_ARGUMENT);
  TablesWriter w(json::object());
  CHECK(code_of([&] { w.add("", 0, 0, {}); }) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code_of([&] { w.add(std::string(33, 'x'), 0, 0, {}); }) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code_of([&] { w.add("has space", 0, 0, {}); }) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code_of([&] { w.add("x", 0, 0, {Piece{nullptr, 4}}); }) == KVS_STATUS_INVALID_ARGUMENT);
  w.add(std::string(32, 'y'), 0, 0, {});
  CHECK(code_of([&] { w.add(std::string(32, 'y'), 0, 0, {}); }) == KVS_STATUS_INVALID_ARGUMENT);
}

TEST_CASE("tables: empty file list and header-only file") {
  TempDir td;
  TablesWriter w(json::object());
  const std::string p = td.file("e.kvs");
  w.write_atomic(p);
  auto f = TablesFile::open(p);
  CHECK(f->sections().empty());
  CHECK(f->header() == json::object());
}

TEST_CASE("tables: truncation at every cut point is FORMAT_TRUNCATED") {
  TempDir td;
  std::mt19937_64 rng(7);
  const std::string p = small_file(td, rng);
  const auto full = read_all(p);
  const std::string cut = td.file("cut.kvs");
  write_all(cut, full);
  for (size_t n = full.size(); n-- > 0;) {
    REQUIRE(::truncate(cut.c_str(), off_t(n)) == 0);  // shrinking in place: fast on any disk
    std::string msg;
    INFO("cut at " << n << " of " << full.size());
    CHECK(open_code(cut, &msg) == KVS_STATUS_FORMAT_TRUNCATED);
    CHECK(msg.find(cut) != std::string::npos);
    const size_t dir_end = 56 + rd64(full, 16) + 3 * 64;
    if (n >= dir_end) CHECK(msg.find("section '") != std::string::npos);
    // describe never throws for corruption
    json d = kvs::io::describe_tables(cut);
    CHECK(d["ok"] == false);
    CHECK(d["error_code"] == int(KVS_STATUS_FORMAT_TRUNCATED));
  }
}

TEST_CASE("tables: every single-bit flip anywhere is detected with the right code") {
  TempDir td;
  std::mt19937_64 rng(11);
  const std::string p = small_file(td, rng);
  const auto full = read_all(p);
  const size_t json_end = 56 + rd64(full, 16);
  const size_t dir_end = json_end + 3 * 64;
  auto f = TablesFile::open(p);
  std::vector<std::pair<size_t, size_t>> payloads;
  std::vector<std::string> tags;
  for (auto& s : f->sections()) {
    payloads.emplace_back(s.offset, s.offset + s.length);
    tags.push_back(s.tag);
  }
  f.reset();
  const std::string bad = td.file("flip.kvs");
  write_all(bad, full);
  // Flip in place (pwrite one byte, then restore): rewriting whole files is slow on some CI disks.
  const int fd = ::open(bad.c_str(), O_WRONLY);
  REQUIRE(fd >= 0);
  for (size_t pos = 0; pos < full.size(); ++pos) {
    for (int bit = 0; bit < 8; ++bit) {
      const uint8_t flipped = uint8_t(full[pos] ^ (1u << bit));
      REQUIRE(::pwrite(fd, &flipped, 1, off_t(pos)) == 1);
      std::string msg;
      const kvs_status got = open_code(bad, &msg);
      INFO("byte " << pos << " bit " << bit << ": " << msg);
      if (pos < 4) {
        CHECK(got == KVS_STATUS_FORMAT_MAGIC);
      } else if (pos < 6) {
        CHECK(got == KVS_STATUS_FORMAT_VERSION);
      } else if (pos < json_end) {
        CHECK(got == KVS_STATUS_FORMAT_CHECKSUM);
        CHECK(msg.find("header checksum") != std::string::npos);
      } else if (pos < dir_end) {
        CHECK(got == KVS_STATUS_FORMAT_CHECKSUM);
        CHECK(msg.find("directory checksum") != std::string::npos);
      } else {
        int in = -1;
        for (size_t s = 0; s < payloads.size(); ++s)
          if (pos >= payloads[s].first && pos < payloads[s].second) in = int(s);
        if (in >= 0) {
          CHECK(got == KVS_STATUS_FORMAT_CHECKSUM);
          CHECK(msg.find("section '" + tags[size_t(in)] + "'") != std::string::npos);
        } else {
          CHECK(got == KVS_STATUS_FORMAT_INVALID);
          CHECK(msg.find("padding") != std::string::npos);
        }
      }
      // Without payload verification, only payload flips go unnoticed.
      if (pos < dir_end)
        CHECK(code_of([&] { TablesFile::open(bad, false); }) != KVS_STATUS_OK);
      if (bit == 0) {
        json dsc = kvs::io::describe_tables(bad);
        CHECK(dsc["ok"] == false);
      }
      REQUIRE(::pwrite(fd, &full[pos], 1, off_t(pos)) == 1);
    }
  }
  ::close(fd);
}

TEST_CASE("tables: magic and version") {
  TempDir td;
  std::mt19937_64 rng(3);
  const std::string p = small_file(td, rng);
  const auto full = read_all(p);
  const std::string q = td.file("v.kvs");
  std::string msg;

  auto d = full;
  d[5] = 0;
  d[4] = 2;  // major 2 (the checksum does not matter: the version is checked first)
  write_all(q, d);
  CHECK(open_code(q, &msg) == KVS_STATUS_FORMAT_VERSION);
  CHECK(msg.find("2.0") != std::string::npos);

  d = full;
  d[6] = 7;  // minor 7: a newer minor is accepted
  reseal(d);
  write_all(q, d);
  REQUIRE(open_code(q) == KVS_STATUS_OK);
  CHECK(TablesFile::open(q)->format_minor() == 7);

  d = full;
  std::memcpy(d.data(), "GGUF", 4);
  write_all(q, d);
  CHECK(open_code(q, &msg) == KVS_STATUS_FORMAT_MAGIC);
  CHECK(msg.find(q) != std::string::npos);

  write_all(q, {'h', 'e', 'l', 'l', 'o', '\n'});
  CHECK(open_code(q) == KVS_STATUS_FORMAT_MAGIC);
  CHECK(code_of([&] { TablesFile::open(td.file("does-not-exist")); }) == KVS_STATUS_IO);

  d = full;
  d[8] = 1, d[9] = 2, d[10] = 3, d[11] = 4;  // big-endian mark
  reseal(d);
  write_all(q, d);
  CHECK(open_code(q, &msg) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("endianness") != std::string::npos);
}

TEST_CASE("tables: structurally invalid files with valid checksums") {
  TempDir td;
  std::mt19937_64 rng(5);
  const std::string p = small_file(td, rng);
  const auto full = read_all(p);
  const std::string q = td.file("s.kvs");
  std::string msg;
  auto run = [&](std::vector<uint8_t> d) {
    reseal(d);
    write_all(q, d);
    return open_code(q, &msg);
  };

  auto d = full;  // misaligned offset
  wr64(d, dir_entry(d, 1) + 40, rd64(d, dir_entry(d, 1) + 40) + 8);
  CHECK(run(d) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("multiple of 64") != std::string::npos);
  CHECK(msg.find("section 'beta' (layer 0, head 1)") != std::string::npos);

  d = full;  // overlap: beta starts where alpha does
  wr64(d, dir_entry(d, 1) + 40, rd64(d, dir_entry(d, 0) + 40));
  CHECK(run(d) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("overlaps") != std::string::npos);

  d = full;  // payload inside the directory
  wr64(d, dir_entry(d, 0) + 40, 0);
  CHECK(run(d) == KVS_STATUS_FORMAT_INVALID);

  d = full;  // length past the end of the file
  wr64(d, dir_entry(d, 2) + 48, uint64_t(1) << 40);
  CHECK(run(d) == KVS_STATUS_FORMAT_TRUNCATED);
  CHECK(msg.find("section 'gamma' (layer -1, head -1)") != std::string::npos);

  d = full;  // length overflowing uint64
  wr64(d, dir_entry(d, 2) + 48, ~uint64_t(0));
  CHECK(run(d) == KVS_STATUS_FORMAT_TRUNCATED);

  d = full;  // huge section count
  wr64(d, 24, uint64_t(1) << 60);
  CHECK(run(d) == KVS_STATUS_FORMAT_TRUNCATED);
  CHECK(msg.find("directory") != std::string::npos);

  d = full;  // huge JSON length
  wr64(d, 16, ~uint64_t(0) - 10);
  wr64(d, 48, kvs::io::checksum64(d.data(), 48));  // reseal only the preamble
  write_all(q, d);
  CHECK(open_code(q, &msg) == KVS_STATUS_FORMAT_TRUNCATED);
  CHECK(msg.find("header") != std::string::npos);

  d = full;  // bad JSON
  d[56] = 'x';
  CHECK(run(d) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("JSON") != std::string::npos);

  d = full;  // duplicate (tag, layer, head)
  std::memcpy(d.data() + dir_entry(d, 1), d.data() + dir_entry(d, 0), 40);
  CHECK(run(d) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("twice") != std::string::npos);

  d = full;  // tag not NUL-padded / non-printable
  d[dir_entry(d, 0) + 31] = 'z';
  CHECK(run(d) == KVS_STATUS_FORMAT_INVALID);
  d = full;
  d[dir_entry(d, 0)] = 0x01;
  CHECK(run(d) == KVS_STATUS_FORMAT_INVALID);
  d = full;
  d[dir_entry(d, 0)] = 0;
  CHECK(run(d) == KVS_STATUS_FORMAT_INVALID);

  d = full;  // trailing bytes
  d.push_back(0);
  CHECK(run(d) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("trailing") != std::string::npos);
}

TEST_CASE("tables: atomic write failures leave no temp file and the target intact") {
  TempDir td;
  std::mt19937_64 rng(9);
  const std::string p = small_file(td, rng);
  const auto before = read_all(p);
  TablesWriter w(json{{"new", true}});
  auto x = random_bytes(rng, 100);
  w.add_copy("x", 0, 0, x.data(), x.size());

  // A path in a missing directory.
  kvs::Error err(KVS_STATUS_OK, "");
  try {
    w.write_atomic(td.file("missing/dir/t.kvs"));
    FAIL("expected an error");
  } catch (const kvs::Error& e) {
    err = e;
  }
  CHECK(err.code() == KVS_STATUS_IO);
  CHECK(err.backend_code() == ENOENT);
  CHECK(std::string(err.what()).find("missing/dir/t.kvs") != std::string::npos);

  // The target is a directory: the final rename fails after everything was written.
  ::mkdir(td.file("adir").c_str(), 0755);
  CHECK(code_of([&] { w.write_atomic(td.file("adir")); }) == KVS_STATUS_IO);

  // A read-only directory (not enforced for root, so only checked when it is).
  TempDir ro;
  const std::string target = ro.file("keep.kvs");
  write_all(target, before);
  ::chmod(ro.path.c_str(), 0555);
  if (::access(ro.path.c_str(), W_OK) != 0) {
    CHECK(code_of([&] { w.write_atomic(target); }) == KVS_STATUS_IO);
    CHECK(read_all(target) == before);
  }
  ::chmod(ro.path.c_str(), 0755);
  CHECK(ro.entries() == std::vector<std::string>{"keep.kvs"});

  std::vector<std::string> ents = td.entries();
  std::sort(ents.begin(), ents.end());
  CHECK(ents == std::vector<std::string>{"adir", "small.kvs"});
  CHECK(read_all(p) == before);

  // Success replaces the target.
  w.write_atomic(p);
  CHECK(TablesFile::open(p)->header() == json{{"new", true}});
}

TEST_CASE("tables: describe_tables reports per-section status") {
  TempDir td;
  std::mt19937_64 rng(13);
  const std::string p = small_file(td, rng);
  json d = kvs::io::describe_tables(p);
  CHECK(d["ok"] == true);
  CHECK(d["error"].is_null());
  CHECK(d["format_version"] == "1.0");
  CHECK(d["header"]["method"] == "test");
  REQUIRE(d["sections"].size() == 3);
  for (auto& s : d["sections"]) CHECK(s["status"] == "ok");
  CHECK(d["bytes_by_tag"]["beta"] == 70);

  auto bytes = read_all(p);
  const auto off = TablesFile::open(p)->require("beta", 0, 1).offset;
  bytes[off + 3] ^= 0x10;
  write_all(p, bytes);
  d = kvs::io::describe_tables(p);
  CHECK(d["ok"] == false);
  CHECK(d["error_code"] == int(KVS_STATUS_FORMAT_CHECKSUM));
  CHECK(d["sections"][0]["status"] == "ok");
  CHECK(d["sections"][1]["status"] == "mismatch");
  CHECK(d["sections"][2]["status"] == "ok");
  CHECK(d["error"].get<std::string>().find("'beta'") != std::string::npos);
  CHECK(code_of([&] { kvs::io::describe_tables(td.file("nope")); }) == KVS_STATUS_IO);
}

TEST_CASE("tables: C API kvs_tables_describe") {
  TempDir td;
  std::mt19937_64 rng(17);
  const std::string p = small_file(td, rng);
  char* out = nullptr;
  kvs_error_t e = kvs_tables_describe(nullptr, &out);
  CHECK(kvs_error_code(e) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(std::string(kvs_error_message(e)).find("path") != std::string::npos);
  kvs_error_destroy(e);
  e = kvs_tables_describe(p.c_str(), nullptr);
  CHECK(kvs_error_code(e) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(std::string(kvs_error_message(e)).find("out_json") != std::string::npos);
  kvs_error_destroy(e);

  e = kvs_tables_describe(p.c_str(), &out);
  REQUIRE(e == nullptr);
  REQUIRE(out != nullptr);
  CHECK(json::parse(out)["ok"] == true);
  kvs_string_free(out);

  auto bytes = read_all(p);
  bytes[60] ^= 1;
  write_all(p, bytes);
  out = nullptr;
  e = kvs_tables_describe(p.c_str(), &out);
  CHECK(kvs_error_code(e) == KVS_STATUS_FORMAT_CHECKSUM);
  REQUIRE(out != nullptr);  // described and reported
  CHECK(json::parse(out)["ok"] == false);
  kvs_string_free(out);
  kvs_error_destroy(e);

  out = nullptr;
  e = kvs_tables_describe(td.file("nope").c_str(), &out);
  CHECK(kvs_error_code(e) == KVS_STATUS_IO);
  CHECK(out == nullptr);
  kvs_error_destroy(e);
}

TEST_CASE("tables: golden file of format 1.0 still loads") {
  const Golden g;
  if (const char* regen = std::getenv("KVS_REGENERATE_GOLDEN")) {
    // KVS_REGENERATE_GOLDEN=<dir>: writes <dir>/tables_v1.0.kvs (only ever for a new version's file).
    g.write(std::string(regen) + "/tables_v1.0.kvs");
  }
  const std::string p = golden_dir() + "/tables_v1.0.kvs";
  INFO("golden file " << p);
  auto f = TablesFile::open(p);
  CHECK(f->format_major() == 1);
  CHECK(f->format_minor() == 0);
  CHECK(f->header() == g.header);
  REQUIRE(f->sections().size() == 6);
  const auto& note = f->require("note", -1, -1);
  CHECK(std::string(reinterpret_cast<const char*>(note.data), note.length) == g.note);
  for (int h = 0; h < 2; ++h) {
    const auto& c = f->require("centroids", 0, h);
    REQUIRE(c.length == g.centroids[h].size() * 4);
    CHECK(std::memcmp(c.data, g.centroids[h].data(), c.length) == 0);
    CHECK(reinterpret_cast<const float*>(c.data)[1] == g.centroids[h][1]);
  }
  const auto& ids = f->require("ids", 1, 0);
  REQUIRE(ids.length == g.ids.size() * 4);
  CHECK(std::memcmp(ids.data, g.ids.data(), ids.length) == 0);
  CHECK(f->require("empty", 1, 1).length == 0);
  const auto& blob = f->require("blob", 1, -1);
  REQUIRE(blob.length == g.blob.size());
  CHECK(std::memcmp(blob.data, g.blob.data(), blob.length) == 0);
  // Offsets of v1.0 are fixed by the layout rules; a writer change must not move them.
  CHECK(f->require("note", -1, -1).offset % 64 == 0);
  CHECK(f->file_size() < 65536);
}
