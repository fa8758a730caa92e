// SPDX-License-Identifier: Apache-2.0
#include "io/file_util.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <random>

#include "core/error.hpp"

namespace kvs::io {
namespace {

[[noreturn]] void fail_errno(const std::string& what, const std::string& path, int err) {
  fail(KVS_STATUS_IO, what + " '" + path + "': " + std::strerror(err), err);
}

std::string dir_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string base_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// Temporary names: "." + base + ".tmp." + PID + "." + counter + "." + random, in the target's
// directory. Parses the part after "." + base + ".tmp."; false unless it is exactly three decimal
// numbers separated by dots (so another target's temporary files never match).
bool parse_tmp_suffix(const char* s, long long* pid) {
  long long fields[3];
  for (int f = 0; f < 3; ++f) {
    if (*s < '0' || *s > '9') return false;
    unsigned long long x = 0;
    int digits = 0;
    for (; *s >= '0' && *s <= '9'; ++s)
      if (++digits > 19) return false;
      else x = x * 10 + unsigned(*s - '0');
    fields[f] = (long long)(x > 0x7fffffffffffffffULL ? 0x7fffffffffffffffULL : x);
    if (f < 2 && *s++ != '.') return false;
  }
  if (*s) return false;
  *pid = fields[0];
  return true;
}

bool process_alive(long long pid) {
  if (pid <= 0 || pid > 0x7fffffff) return false;
  // EPERM: it exists but belongs to someone else.
  return ::kill(pid_t(pid), 0) == 0 || errno != ESRCH;
}

}  // namespace

void remove_stale_temporaries(const std::string& path, int64_t max_age_seconds) {
  const std::string dir = dir_of(path), prefix = "." + base_of(path) + ".tmp.";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;  // the write itself reports a directory it cannot use
  const long long self = ::getpid();
  const time_t now = ::time(nullptr);
  while (const dirent* e = ::readdir(d)) {
    long long pid = 0;
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) != 0 || !parse_tmp_suffix(e->d_name + prefix.size(), &pid))
      continue;
    const std::string tmp = dir + "/" + e->d_name;
    // Regular files only (never open a device, FIFO or symlink someone named like this).
    struct stat named;
    if (::lstat(tmp.c_str(), &named) != 0 || !S_ISREG(named.st_mode)) continue;
    // A live writer holds the lock from just after creating the file until after its rename.
    const int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) continue;
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || ::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd);
      continue;
    }
    // Unlocked: its writer is gone, unless it is between creating the file and taking the lock
    // (or wrote the file with an older kvsieve that took no lock). Its PID tells, except after
    // PID reuse: then only the age does.
    const bool dead = pid != self && !process_alive(pid);
    const bool old = now - st.st_mtime > max_age_seconds;
    if (dead || old) {
      // Still the same file under the lock (not replaced since it was opened)?
      struct stat cur;
      if (::lstat(tmp.c_str(), &cur) == 0 && cur.st_ino == st.st_ino && cur.st_dev == st.st_dev) ::unlink(tmp.c_str());
    }
    ::close(fd);
  }
  ::closedir(d);
}

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  std::shared_ptr<MappedFile> m(new MappedFile());
  m->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_errno("cannot open", path, errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail_errno("cannot stat", path, e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(KVS_STATUS_IO, "cannot map '" + path + "': not a regular file", EINVAL);
  }
  m->size_ = uint64_t(st.st_size);
  if (m->size_ > 0) {
    void* p = ::mmap(nullptr, size_t(m->size_), PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      fail_errno("cannot mmap", path, e);
    }
    m->data_ = static_cast<const std::byte*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
  return m;
}

std::shared_ptr<MappedFile> MappedFile::wrap(std::shared_ptr<const void> owner, const std::byte* data, uint64_t size,
                                             std::string name) {
  std::shared_ptr<MappedFile> m(new MappedFile());
  m->path_ = std::move(name);
  m->data_ = data;
  m->size_ = size;
  m->owner_ = std::move(owner);
  return m;
}

MappedFile::~MappedFile() {
  if (data_ && !owner_) ::munmap(const_cast<std::byte*>(data_), size_t(size_));
}

void FileSink::write(const void* data, uint64_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    size_t chunk = size_t(size < (uint64_t(1) << 30) ? size : (uint64_t(1) << 30));
    ssize_t n = ::write(fd_, p, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno("cannot write", tmp_path_, errno);
    }
    p += n;
    size -= uint64_t(n);
    pos_ += uint64_t(n);
  }
}

void FileSink::write_zeros(uint64_t size) {
  static const char zeros[4096] = {};
  while (size > 0) {
    uint64_t n = size < sizeof zeros ? size : sizeof zeros;
    write(zeros, n);
    size -= n;
  }
}

void write_file_atomic(const std::string& path, const std::function<void(FileSink&)>& body) {
  if (path.empty()) fail(KVS_STATUS_INVALID_ARGUMENT, "path is empty");
  const std::string dir = dir_of(path);
  // Space first: a save killed before its rename left its temporary file behind.
  remove_stale_temporaries(path, kStaleTemporarySeconds);
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  std::string tmp;
  int fd = -1;
  // O_EXCL with our own unique name (instead of mkstemp) so the final file gets the usual
  // 0666 & ~umask permissions.
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    tmp = dir + "/." + base_of(path) + ".tmp." + std::to_string(::getpid()) + "." +
          std::to_string(counter.fetch_add(1)) + "." + std::to_string(rd());
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) {
      int e = errno;
      fail(KVS_STATUS_IO,
           "cannot write '" + path + "': cannot create temporary file in '" + dir + "': " +
               std::strerror(e),
           e);
    }
    if (fd < 0) continue;
    // The lock tells remove_stale_temporaries (of this or another process) that the file is being
    // written; it is held until after the rename. Advisory: a file system without flock support
    // leaves the PID and age rules alone to protect the file.
    (void)::flock(fd, LOCK_EX);
    // A cleaner that found the file before the lock removes it only when it takes our PID for a
    // dead one (another PID namespace sharing the directory): then start over under a new name.
    struct stat mine, named;
    if (::fstat(fd, &mine) != 0 || ::lstat(tmp.c_str(), &named) != 0 || mine.st_ino != named.st_ino ||
        mine.st_dev != named.st_dev) {
      ::close(fd);
      fd = -1;
    }
  }
  if (fd < 0) fail(KVS_STATUS_IO, "cannot write '" + path + "': no free temporary name", EEXIST);

  // flock belongs to the open file description: the duplicate keeps the lock held after fd is
  // closed (the close is checked before the rename) until after the rename.
  int lock_fd = -1;
  try {
    lock_fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (lock_fd < 0) fail_errno("cannot duplicate the descriptor of", tmp, errno);
    FileSink sink(fd, tmp);
    body(sink);
    if (::fsync(fd) != 0) fail_errno("cannot fsync", tmp, errno);
    int rc = ::close(fd);
    fd = -1;
    if (rc != 0) fail_errno("cannot close", tmp, errno);
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      int e = errno;
      fail(KVS_STATUS_IO,
           "cannot write '" + path + "': rename from temporary file failed: " + std::strerror(e), e);
    }
  } catch (...) {
    ::unlink(tmp.c_str());
    if (fd >= 0) ::close(fd);
    if (lock_fd >= 0) ::close(lock_fd);
    throw;
  }
  ::close(lock_fd);
  // The rename is durable only once the directory entry is on disk.
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) fail_errno("wrote the file but cannot open its directory to fsync", dir, errno);
  if (::fsync(dfd) != 0 && errno != EINVAL && errno != ENOTSUP) {
    int e = errno;
    ::close(dfd);
    fail_errno("wrote the file but cannot fsync its directory", dir, e);
  }
  ::close(dfd);
}

}  // namespace kvs::io
