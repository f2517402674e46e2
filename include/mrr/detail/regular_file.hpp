// Opening files that mrr reads (route files, .npy imports, configs) without ever blocking: a FIFO,
// socket, device or directory where a file is expected is an error naming what it is, never a
// read that waits forever for a writer that does not come.
#pragma once

#include <mrr/detail/config.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

MRR_NAMESPACE_BEGIN
namespace detail {

// What kind of file `mode` is, for messages: "a FIFO", "a directory", ...
inline const char* file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

// The result of open_regular_file: fd >= 0 on success; otherwise either the open failed (fd = -1,
// err = errno) or the path is not a regular file (fd = -1, err = 0, kind says what it is).
struct RegularFile {
  int fd = -1;
  int err = 0;
  const char* kind = nullptr;
  bool ok() const { return fd >= 0; }
  bool not_regular() const { return fd < 0 && kind != nullptr; }
};

// open(2) with O_NONBLOCK (so opening a FIFO returns at once instead of waiting for a writer),
// then fstat on the descriptor itself (no window between the check and the open): anything but a
// regular file is closed and reported. O_NONBLOCK is cleared again on success; it has no effect
// on regular files anyway. O_CLOEXEC is always added.
inline RegularFile open_regular_file(const char* path, int flags, mode_t create_mode = 0644) {
  RegularFile out;
  const int fd = ::open(path, flags | O_NONBLOCK | O_CLOEXEC, create_mode);
  if (fd < 0) {
    out.err = errno;
    return out;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    out.err = errno;
    ::close(fd);
    return out;
  }
  if (!S_ISREG(st.st_mode)) {
    out.kind = file_kind(st.st_mode);
    ::close(fd);
    return out;
  }
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl != -1) (void)::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  out.fd = fd;
  return out;
}

// Owns a file descriptor; closes it when destroyed.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  }

 private:
  int fd_ = -1;
};

}  // namespace detail
MRR_NAMESPACE_END
