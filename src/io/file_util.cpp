#include "io/file_util.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
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

}  // namespace

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

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<std::byte*>(data_), size_t(size_));
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
  }
  if (fd < 0) fail(KVS_STATUS_IO, "cannot write '" + path + "': no free temporary name", EEXIST);

  try {
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
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
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
