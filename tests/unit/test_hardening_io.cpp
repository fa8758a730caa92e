// SPDX-License-Identifier: Apache-2.0
// Issue 22 (hardening): stale temporary files of killed saves (src/io/file_util.*: finding 5) and
// the overlap check of output tensors (src/core/tensor.*: finding 7).
#include <dirent.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "io/file_util.hpp"
#include "kvsieve/kvsieve.h"

namespace {

struct TempDir {
  std::string path;
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/kvs_hardening_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    REQUIRE(::mkdtemp(buf.data()) != nullptr);
    path = buf.data();
  }
  ~TempDir() { (void)std::system(("rm -rf '" + path + "'").c_str()); }
  std::string file(const std::string& name) const { return path + "/" + name; }
  bool has(const std::string& name) const {
    struct stat st;
    return ::lstat(file(name).c_str(), &st) == 0;
  }
  std::vector<std::string> entries() const {
    std::vector<std::string> r;
    if (DIR* d = ::opendir(path.c_str())) {
      while (dirent* e = ::readdir(d))
        if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) r.push_back(e->d_name);
      ::closedir(d);
    }
    std::sort(r.begin(), r.end());
    return r;
  }
  // Names starting with prefix.
  std::vector<std::string> with_prefix(const std::string& prefix) const {
    std::vector<std::string> r;
    for (auto& e : entries())
      if (e.rfind(prefix, 0) == 0) r.push_back(e);
    return r;
  }
};

void put(const std::string& path, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  std::string chunk(4096, 'x');
  for (size_t n = 0; n < bytes; n += chunk.size()) f.write(chunk.data(), std::streamsize(std::min(chunk.size(), bytes - n)));
}

// The PID of a process that has exited and been reaped (not alive, barring reuse within the test).
pid_t dead_pid() {
  const pid_t c = ::fork();
  if (c == 0) ::_exit(0);
  REQUIRE(c > 0);
  int st = 0;
  REQUIRE(::waitpid(c, &st, 0) == c);
  REQUIRE(::kill(c, 0) != 0);
  return c;
}

void write_text(const std::string& path, const std::string& text) {
  kvs::io::write_file_atomic(path, [&](kvs::io::FileSink& s) { s.write(text.data(), text.size()); });
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void age(const std::string& path, int seconds) {
  struct timeval tv[2];
  ::gettimeofday(&tv[0], nullptr);
  tv[0].tv_sec -= seconds;
  tv[1] = tv[0];
  REQUIRE(::utimes(path.c_str(), tv) == 0);
}

}  // namespace

TEST_CASE("atomic write: the next write to a path removes the stale temporary files of that path only") {
  TempDir td;
  const std::string dead = std::to_string(dead_pid()), parent = std::to_string(::getppid()),
                    self = std::to_string(::getpid());
  const std::string stale = ".t.kvt.tmp." + dead + ".0.123";        // a killed save: removed
  const std::string stale_old = ".t.kvt.tmp." + parent + ".3.9";    // live PID, 2 h old, unlocked: removed
  const std::string live = ".t.kvt.tmp." + parent + ".1.77";        // live PID, fresh: kept
  const std::string own = ".t.kvt.tmp." + self + ".5.5";            // this process, fresh: kept
  const std::string locked = ".t.kvt.tmp." + dead + ".2.4";         // dead PID but a writer holds the lock: kept
  const std::string other = ".u.kvt.tmp." + dead + ".0.1";          // another target's: kept
  const std::string longer = ".t.kvt.x.tmp." + dead + ".0.1";       // target "t.kvt.x": kept
  const std::string odd[] = {".t.kvt.tmp." + dead + ".x.1", ".t.kvt.tmp." + dead + ".0.1.2",
                             ".t.kvt.tmp." + dead, ".t.kvt.tmp." + dead + ".0.1~", ".t.kvt.tmp.-" + dead + ".0.1"};
  const std::string link = ".t.kvt.tmp." + dead + ".8.8";           // a symlink named like one: kept
  put(td.file(stale), 1 << 20);
  put(td.file(stale_old), 100);
  age(td.file(stale_old), 2 * 3600);
  put(td.file(live), 100);
  put(td.file(own), 100);
  put(td.file(locked), 100);
  put(td.file(other), 100);
  put(td.file(longer), 100);
  for (auto& o : odd) put(td.file(o), 10);
  put(td.file("victim"), 10);
  REQUIRE(::symlink(td.file("victim").c_str(), td.file(link).c_str()) == 0);
  const int lock_fd = ::open(td.file(locked).c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(lock_fd >= 0);
  REQUIRE(::flock(lock_fd, LOCK_EX) == 0);

  write_text(td.file("t.kvt"), "hello");

  CHECK(read_text(td.file("t.kvt")) == "hello");
  CHECK_FALSE(td.has(stale));
  CHECK_FALSE(td.has(stale_old));
  CHECK(td.has(live));
  CHECK(td.has(own));
  CHECK(td.has(locked));
  CHECK(td.has(other));
  CHECK(td.has(longer));
  for (auto& o : odd) CHECK(td.has(o));
  CHECK(td.has(link));
  CHECK(td.has("victim"));
  ::close(lock_fd);

  // Unlocked now, dead PID: the next write removes it; the other target's waits for its own.
  write_text(td.file("t.kvt"), "again");
  CHECK_FALSE(td.has(locked));
  CHECK(td.has(other));
  write_text(td.file("u.kvt"), "u");
  CHECK_FALSE(td.has(other));
  // A successful write leaves no temporary file of its own.
  CHECK(td.with_prefix(".t.kvt.tmp." + self + ".").size() == 1);  // `own` only
}

TEST_CASE("atomic write: a temporary file another thread is writing is kept, and its write completes") {
  TempDir td;
  const std::string target = td.file("s.kvt"), prefix = ".s.kvt.tmp.";
  std::mutex m;
  std::condition_variable cv;
  bool started = false, go = false;
  std::string error;
  std::thread writer([&] {
    try {
      kvs::io::write_file_atomic(target, [&](kvs::io::FileSink& s) {
        s.write("first half,", 11);
        std::unique_lock<std::mutex> l(m);
        started = true;
        cv.notify_all();
        cv.wait(l, [&] { return go; });
        s.write(" second half", 12);
      });
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  {
    std::unique_lock<std::mutex> l(m);
    cv.wait(l, [&] { return started; });
  }
  const auto mid = td.with_prefix(prefix);
  REQUIRE(mid.size() == 1);
  // Even aged past the stale limit, a locked temporary file is a live writer's.
  age(td.file(mid[0]), 2 * 3600);
  write_text(target, "other writer");
  CHECK(read_text(target) == "other writer");
  CHECK(td.has(mid[0]));
  {
    std::lock_guard<std::mutex> l(m);
    go = true;
  }
  cv.notify_all();
  writer.join();
  CHECK(error == "");
  CHECK(read_text(target) == "first half, second half");
  CHECK(td.with_prefix(prefix).empty());
}

TEST_CASE("atomic write: a save killed by SIGKILL leaves its temporary file; the next save removes it") {
  TempDir td;
  const std::string target = td.file("k.kvt"), prefix = ".k.kvt.tmp.";
  const pid_t c = ::fork();
  if (c == 0) {
    // The child: half a file written, then killed (as the audit's SIGKILL trials did).
    try {
      kvs::io::write_file_atomic(target, [&](kvs::io::FileSink& s) {
        s.write_zeros(1 << 20);
        ::kill(::getpid(), SIGKILL);
        for (;;) ::pause();
      });
    } catch (...) {
    }
    ::_exit(3);
  }
  REQUIRE(c > 0);
  int st = 0;
  REQUIRE(::waitpid(c, &st, 0) == c);
  REQUIRE(WIFSIGNALED(st));
  CHECK(WTERMSIG(st) == SIGKILL);
  const auto left = td.with_prefix(prefix + std::to_string(c) + ".");
  REQUIRE(left.size() == 1);  // the leak of finding 5
  CHECK_FALSE(td.has("k.kvt"));
  write_text(target, "saved");
  CHECK(read_text(target) == "saved");
  CHECK(td.with_prefix(prefix).empty());
}

TEST_CASE("kvs_session_save removes a stale temporary file of its target, and keeps a live one") {
  TempDir td;
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = 1;
  p.num_q_heads = 2;
  p.num_kv_heads = 1;
  p.head_dim = 8;
  p.kv_dtype = KVS_SCALAR_F32;
  kvs_session_t s = nullptr;
  REQUIRE(kvs_session_create(&p, &s) == nullptr);
  std::vector<float> q(4 * 2 * 8, 0.5f), k(4 * 8, 0.25f);
  int64_t qs[3] = {4, 2, 8}, ks[3] = {4, 1, 8};
  kvs_tensor tq{q.data(), {KVS_DEVICE_CPU, 0}, 3, {KVS_DTYPE_CODE_FLOAT, 32, 1}, qs, nullptr, 0};
  kvs_tensor tk{k.data(), {KVS_DEVICE_CPU, 0}, 3, {KVS_DTYPE_CODE_FLOAT, 32, 1}, ks, nullptr, 0};
  REQUIRE(kvs_session_prefill(s, 0, &tq, &tk, &tk, nullptr, nullptr) == nullptr);
  REQUIRE(kvs_session_build_index(s, nullptr) == nullptr);
  const std::string stale = ".sess.kvt.tmp." + std::to_string(dead_pid()) + ".0.42";
  const std::string live = ".sess.kvt.tmp." + std::to_string(::getppid()) + ".0.43";
  put(td.file(stale), 1 << 16);
  put(td.file(live), 10);
  kvs_error_t e = kvs_session_save(s, td.file("sess.kvt").c_str(), KVS_SAVE_INCLUDE_KV);
  CHECK(e == nullptr);
  kvs_error_destroy(e);
  CHECK(td.has("sess.kvt"));
  CHECK_FALSE(td.has(stale));
  CHECK(td.has(live));
  kvs_session_destroy(s);
}

// ---- output tensors must not overlap -----------------------------------------------------------

namespace {

kvs::View view(std::initializer_list<int64_t> shape, std::initializer_list<int64_t> strides) {
  kvs::View v;
  v.ndim = int(shape.size());
  int i = 0;
  for (int64_t s : shape) v.shape[i++] = s;
  i = 0;
  for (int64_t s : strides) v.strides[i++] = s;
  return v;
}

std::string overlap_error(const kvs::View& v) {
  try {
    kvs::check_no_overlap(v, "o");
  } catch (const kvs::Error& e) {
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("check_no_overlap: refuses exactly the strides that put two elements at one address") {
  // Dense, transposed, padded, broadcast over extent 1, empty: accepted.
  CHECK(overlap_error(view({4, 16}, {16, 1})) == "");
  CHECK(overlap_error(view({4, 16}, {1, 4})) == "");
  CHECK(overlap_error(view({3, 4, 16}, {128, 32, 1})) == "");
  CHECK(overlap_error(view({1, 16}, {0, 1})) == "");
  CHECK(overlap_error(view({0, 16}, {0, 0})) == "");
  CHECK(overlap_error(view({1}, {0})) == "");
  // Interleaved but injective (offsets 0 2 4 3 5 7): decided exactly.
  CHECK(overlap_error(view({3, 2}, {2, 3})) == "");
  // A zero stride on an extent > 1, all-zero strides, interleaved collisions: refused, naming "o".
  std::string e = overlap_error(view({4, 16}, {0, 0}));
  CHECK(e.find("o: an output tensor's elements must not overlap") == 0);
  CHECK(e.find("stride 0") != std::string::npos);
  CHECK(overlap_error(view({4, 16}, {0, 1})).find("dimension 0 has stride 0") != std::string::npos);
  CHECK(overlap_error(view({8}, {0})) != "");
  CHECK(overlap_error(view({3, 2}, {1, 2})).find("same offset") != std::string::npos);  // (2,0) = (0,1)
  CHECK(overlap_error(view({4, 16}, {8, 1})) != "");                                   // rows overlap by half
  // Too large to list and not nested: refused as unverifiable; offsets past 64 bits: refused.
  CHECK(overlap_error(view({4096, 2048}, {2, 3})).find("cannot be checked") != std::string::npos);
  CHECK(overlap_error(view({3, 2}, {int64_t(1) << 62, int64_t(1) << 62})).find("overflows") != std::string::npos);
  // Large and nested: accepted without listing.
  CHECK(overlap_error(view({1 << 16, 32, 128}, {32 * 128, 128, 1})) == "");
}

TEST_CASE("check_output_tensor: check_tensor plus the overlap check, naming the tensor") {
  std::vector<float> buf(64);
  int64_t shape[2] = {4, 16}, zero[2] = {0, 0}, dense[2] = {16, 1};
  kvs_tensor t{buf.data(), {KVS_DEVICE_CPU, 0}, 2, {KVS_DTYPE_CODE_FLOAT, 32, 1}, shape, zero, 0};
  try {
    kvs::check_output_tensor(&t, "lse", {4, 16}, kvs::Where::Host);
    FAIL("accepted all-zero strides");
  } catch (const kvs::Error& e) {
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(std::string(e.what()).rfind("lse: ", 0) == 0);
  }
  t.strides = dense;
  CHECK(kvs::check_output_tensor(&t, "lse", {4, 16}, kvs::Where::Host).numel() == 64);
  t.strides = nullptr;
  CHECK(kvs::check_output_tensor(&t, "lse", {4, 16}, kvs::Where::Host).contiguous());
  // Inputs may still broadcast (a zero stride is a legitimate read).
  t.strides = zero;
  CHECK(kvs::check_tensor(&t, "q", {4, 16}, kvs::Where::Host).strides[0] == 0);
}
