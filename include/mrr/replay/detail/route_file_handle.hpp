// The POSIX side of a route file, apart from its format: opening (regular files only, symlinks
// that lead nowhere named as such), the one-writer lock, positioned reads and writes, and the
// checks that the file an open store uses is still the one it opened. FileRouteStore
// (mrr/replay/file_store.hpp) builds the format on it.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/regular_file.hpp>
#include <mrr/error.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace detail {

class RouteFileHandle {
 public:
  static constexpr std::size_t kHeaderBytes = 64;  // route_file::kHeaderBytes
  using HeaderBytes = std::array<unsigned char, kHeaderBytes>;

  RouteFileHandle() = default;
  RouteFileHandle(RouteFileHandle&& o) noexcept { *this = std::move(o); }
  RouteFileHandle& operator=(RouteFileHandle&& o) noexcept {
    if (this != &o) {
      fd_ = UniqueFd(std::move(o.fd_));
      path_ = std::move(o.path_);
      absolute_path_ = std::move(o.absolute_path_);
      identity_ = o.identity_;
      writable_ = std::exchange(o.writable_, false);
      header_ = o.header_;
      name_unsynced_ = std::exchange(o.name_unsynced_, false);
      sync_error_ = std::move(o.sync_error_);
    }
    return *this;
  }
  RouteFileHandle(const RouteFileHandle&) = delete;
  RouteFileHandle& operator=(const RouteFileHandle&) = delete;

  // A new, empty file, locked for writing; an existing path is an error (records are never
  // overwritten).
  static RouteFileHandle create(const std::filesystem::path& path) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) throw_create_error(path);
    RouteFileHandle h = locked(path, fd);
    h.name_unsynced_ = true;
    return h;
  }

  // An existing regular file, read-only and unlocked: readers never wait for writers.
  static RouteFileHandle open_for_reading(const std::filesystem::path& path) {
    RouteFileHandle h;
    h.fd_ = UniqueFd(checked(path, open_regular_file(path.c_str(), O_RDONLY)));
    h.path_ = path;
    return h;
  }

  // The file at `path`, created (empty) when missing, locked for writing.
  static RouteFileHandle open_for_appending(const std::filesystem::path& path) {
    RegularFile f = open_regular_file(path.c_str(), O_RDWR);
    bool created = false;
    if (!f.ok() && f.err == ENOENT && !std::filesystem::is_symlink(std::filesystem::symlink_status(path))) {
      f.fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (f.fd < 0 && errno != EEXIST) throw_create_error(path);
      created = f.fd >= 0;
      if (f.fd < 0) f = open_regular_file(path.c_str(), O_RDWR);  // another process created it meanwhile
    }
    RouteFileHandle h = locked(path, checked(path, f));
    h.name_unsynced_ = created;
    return h;
  }

  const std::filesystem::path& path() const { return path_; }
  bool is_open() const { return fd_.get() >= 0; }
  bool writable() const { return writable_; }

  // Ends writing: releases the lock (the descriptor stays open for reading).
  void unlock() {
    if (writable_ && is_open()) (void)::flock(fd_.get(), LOCK_UN);
  }

  std::uint64_t size() const {
    struct stat st {};
    if (::fstat(fd_.get(), &st) != 0)
      throw RouteFileError(str("route file ", path_.string(), ": fstat failed: ", std::strerror(errno)));
    return static_cast<std::uint64_t>(st.st_size);
  }

  // Exactly n bytes at `offset`. Every byte a store reads was in the file when it opened or wrote
  // it, so an end of file here means the file was truncated underneath it.
  void read_exact(void* out, std::size_t n, std::uint64_t offset) const {
    auto* p = static_cast<unsigned char*>(out);
    while (n > 0) {
      const ssize_t got = ::pread(fd_.get(), p, n, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) throw_read_error(got, offset);
      p += got;
      n -= static_cast<std::size_t>(got);
      offset += static_cast<std::uint64_t>(got);
    }
  }

  // The file's bytes from `offset` into `pieces` one after another (a scatter read: one preadv
  // unless the kernel reads short), as read_exact. At most kMaxReadPieces pieces; empty ones are
  // allowed. The pieces are consumed (their bases and lengths advance).
  static constexpr int kMaxReadPieces = 1024;  // Linux's IOV_MAX
  void read_exact(iovec* pieces, int count, std::uint64_t offset) const {
    if (count > kMaxReadPieces) throw RouteFileError(str("mrr: internal error: a read of ", count, " pieces"));
    for (skip_pieces(pieces, count, 0); count > 0;) {
      const ssize_t got = ::preadv(fd_.get(), pieces, count, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) throw_read_error(got, offset);
      offset += static_cast<std::uint64_t>(got);
      skip_pieces(pieces, count, static_cast<std::size_t>(got));
    }
  }

  // Reads n bytes at `offset` into buf (grown as needed) and returns them.
  const unsigned char* read_at(std::uint64_t offset, std::size_t n, std::vector<unsigned char>& buf) const {
    if (buf.size() < n) buf.resize(std::max(n, 2 * buf.size()));
    read_exact(buf.data(), n, offset);
    return buf.data();
  }

  // Writes all n bytes at `offset`; on failure the file is cut back to `offset`, so no partial
  // record is left for the next append.
  void write_all(const void* data, std::size_t n, std::uint64_t offset) {
    const iovec piece{const_cast<void*>(data), n};
    write_all(&piece, 1, offset);
  }

  // The pieces written one after another from `offset`, with as few system calls as the kernel
  // allows (one pwritev for a record call, unless it writes short); on an error the file is cut
  // back to `offset` (reopening reports what a crash would leave as a torn tail) and it throws.
  void write_all(const iovec* pieces, int count, std::uint64_t offset) {
    constexpr int kMaxPieces = 8;
    iovec left[kMaxPieces];
    if (count > kMaxPieces) throw RouteFileError(str("mrr: internal error: a write of ", count, " pieces"));
    std::copy_n(pieces, count, left);
    iovec* next = left;
    const std::uint64_t start = offset;
    for (skip_pieces(next, count, 0); count > 0;) {
      const ssize_t put = ::pwritev(fd_.get(), next, count, static_cast<off_t>(offset));
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) {
        const int err = errno;
        // Cut back what this call wrote; when that fails too, the file may keep whole records of
        // a call that failed (they are the caller's ids, and reopening reads them): say so.
        std::string cut;
        if (::ftruncate(fd_.get(), static_cast<off_t>(start)) != 0 && offset > start)
          cut = str("; cutting the file back to offset ", start, " failed too (", std::strerror(errno),
                    "), so records of this write may remain in it: reopen the file to see what it holds");
        throw RouteFileError(
            str("route file ", path_.string(), ": write failed at offset ", offset, ": ", std::strerror(err), cut));
      }
      offset += static_cast<std::uint64_t>(put);
      skip_pieces(next, count, static_cast<std::size_t>(put));
    }
  }

  void truncate(std::uint64_t size, const char* why) {
    if (::ftruncate(fd_.get(), static_cast<off_t>(size)) != 0)
      throw RouteFileError(str("route file ", path_.string(), ": cannot truncate ", why, ": ", std::strerror(errno)));
  }

  // Asks the device to persist what was written, and, for a file this handle created, the
  // directory entry that names it (a file synced but not its name can vanish at a power loss). A
  // failure is sticky: once fdatasync failed, the kernel may have dropped the pages it could not
  // write and a later fdatasync can succeed without them, so every later call fails the same way.
  bool sync_failed() const { return !sync_error_.empty(); }
  void sync() {
    if (!is_open() || !writable_) return;
    if (!sync_error_.empty()) throw RouteFileError(sync_error_);
    const auto fail = [&](const char* what) {
      sync_error_ = str("route file ", path_.string(), ": ", what, " failed: ", std::strerror(errno),
                        "; what was written since it opened is not known to be on the device (a later sync cannot "
                        "tell), so every later sync or close fails too: reopen the file to see what it holds");
      throw RouteFileError(sync_error_);
    };
    if (::fdatasync(fd_.get()) != 0) fail("fdatasync");
    if (name_unsynced_) {
      std::filesystem::path dir = absolute_path_.empty() ? path_.parent_path() : absolute_path_.parent_path();
      if (dir.empty()) dir = ".";
      const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (dfd < 0) fail("opening its directory to sync it");
      const int rc = ::fsync(dfd);
      const int err = errno;
      ::close(dfd);
      errno = err;
      if (rc != 0 && errno != EINVAL) fail("fsync of its directory");  // EINVAL: a file system without it
      name_unsynced_ = false;
    }
  }

  // The file's header as this store read or wrote it: what check_unchanged compares against.
  void set_header(const unsigned char* bytes) { std::memcpy(header_.data(), bytes, kHeaderBytes); }
  const HeaderBytes& header() const { return header_; }

  // Whatever was read is from the file this store opened: the header (with its random file id)
  // must still be the one it had. Called after reading, so a file replaced in place (another
  // route file copied over it: truncated, then written from the start) is caught even when the
  // copy raced the read. A file truncated under a reader shows as a short read (read_exact).
  void check_unchanged(const char* fn) const {
    HeaderBytes now{};
    const ssize_t got = ::pread(fd_.get(), now.data(), now.size(), 0);
    if (got != static_cast<ssize_t>(now.size()) || now != header_)
      throw RouteFileError(str("mrr::", fn, ": route file ", path_.string(),
                               " was replaced or rewritten while open (its header is no longer the one it had when "
                               "opened); refusing to return routes read from it: reopen it"));
  }

  // The file still holds at least `size` bytes (what the store has seen of it): a store answering
  // from memory (records it keeps) notices a truncation as a read would.
  void check_not_truncated(const char* fn, std::uint64_t size) const {
    struct stat st {};
    if (::fstat(fd_.get(), &st) != 0 || static_cast<std::uint64_t>(st.st_size) < size)
      throw RouteFileError(str("mrr::", fn, ": route file ", path_.string(), " is ", st.st_size,
                               " bytes, shorter than the ", size,
                               " it held when opened: it was truncated or replaced while open; refusing to return "
                               "routes from it"));
  }

  // A writer's records must reach the file its path names: if the path was renamed over or
  // removed, they would go to an unlinked file (lost at close) while another writer could take
  // the path; if the file was truncated or written by someone else (its size is not the
  // `expected_size` this writer left), they would land in a file that no longer matches what the
  // writer knows. Each is an error before anything is written.
  void check_still_ours(const char* fn, std::uint64_t expected_size) const {
    struct stat path_st {}, fd_st {};
    const bool named = ::stat(absolute_path_.c_str(), &path_st) == 0;
    if (!named || path_st.st_dev != identity_.first || path_st.st_ino != identity_.second)
      throw RouteFileError(str("mrr::", fn, ": route file ", path_.string(), " was ",
                               named ? "replaced (another file renamed over it)" : "removed",
                               " while this writer had it open; its records would go to a file no path names, so "
                               "nothing more is recorded (what was recorded before is in the file this writer opened)"));
    if (::fstat(fd_.get(), &fd_st) != 0 || static_cast<std::uint64_t>(fd_st.st_size) != expected_size)
      throw RouteFileError(str("mrr::", fn, ": route file ", path_.string(), " is ", fd_st.st_size,
                               " bytes where this writer left ", expected_size,
                               ": another program truncated or wrote it while it was open for recording; nothing "
                               "more is recorded"));
    check_unchanged(fn);
  }

 private:
  // Advances `pieces` (count of them) past `done` bytes read or written, and past every empty
  // piece after them.
  static void skip_pieces(iovec*& pieces, int& count, std::size_t done) {
    while (count > 0 && (done > 0 || pieces->iov_len == 0)) {
      const std::size_t step = std::min(done, pieces->iov_len);
      pieces->iov_base = static_cast<unsigned char*>(pieces->iov_base) + step;
      pieces->iov_len -= step;
      done -= step;
      if (pieces->iov_len == 0) {
        ++pieces;
        --count;
      }
    }
  }

  // A read that failed (got < 0) or met the end of the file (got == 0) at `offset`.
  [[noreturn]] void throw_read_error(ssize_t got, std::uint64_t offset) const {
    if (got < 0)
      throw RouteFileError(
          str("route file ", path_.string(), ": read failed at offset ", offset, ": ", std::strerror(errno)));
    throw RouteFileError(str("route file ", path_.string(), " ends at offset ", offset,
                             ", before bytes it held when opened: it was truncated or replaced while open; "
                             "refusing to return routes from it"));
  }

  // Takes the one-writer lock on a freshly opened descriptor (closed if that fails) and records
  // the file's identity for check_still_ours.
  static RouteFileHandle locked(const std::filesystem::path& path, int fd) {
    RouteFileHandle h;
    h.fd_ = UniqueFd(fd);
    h.path_ = path;
    lock_for_writing(fd, path);  // throws; h closes fd
    h.writable_ = true;
    struct stat st {};
    if (::fstat(fd, &st) == 0) h.identity_ = {st.st_dev, st.st_ino};
    std::error_code ec;
    h.absolute_path_ = std::filesystem::absolute(path, ec);  // immune to a later chdir
    if (ec) h.absolute_path_ = path;
    return h;
  }

  // One writer per file: flock(LOCK_EX | LOCK_NB) on the open file, released by unlock() or when
  // it is closed (or the process dies). Filesystems without flock support are written unlocked.
  static void lock_for_writing(int fd, const std::filesystem::path& path) {
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return;
    const int err = errno;
    if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS) return;
    if (err == EWOULDBLOCK)
      throw RouteFileError(str("route file ", path.string(),
                               " is locked by another writer (a FileRouteStore created or appended to it and has not "
                               "closed it); close that writer first, or record to another file"));
    throw RouteFileError(str("route file ", path.string(), ": cannot lock it for writing: ", std::strerror(err)));
  }

  // The descriptor of a successful open_regular_file, else the error it calls for.
  static int checked(const std::filesystem::path& path, const RegularFile& f) {
    if (f.not_regular())
      throw RouteFileError(str("cannot open route file ", path.string(), ": it is ", f.kind,
                               ", not a regular file (route files are read with positioned reads)"));
    if (!f.ok()) {
      errno = f.err;
      throw_open_error(path);
    }
    return f.fd;
  }

  // What a symlink at `path` is when it leads nowhere ("" when it is no such symlink): open()
  // alone only says "File exists" or "No such file".
  static std::string broken_symlink(const std::filesystem::path& path) {
    std::error_code ec;
    if (!std::filesystem::is_symlink(std::filesystem::symlink_status(path, ec))) return "";
    const std::string target = std::filesystem::read_symlink(path, ec).string();
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0) return "";
    if (errno == ELOOP) return str("is a symlink loop (", path.string(), " -> ", target, " -> ...)");
    if (errno == ENOENT) return str("is a dangling symlink to ", target, ", which does not exist");
    return "";
  }

  [[noreturn]] static void throw_create_error(const std::filesystem::path& path) {
    const int err = errno;
    if (const std::string link = broken_symlink(path); !link.empty())
      throw RouteFileError(str("cannot create route file ", path.string(), ": it ", link,
                               "; remove the link or make it point at a usable path"));
    throw RouteFileError(str("cannot create route file ", path.string(), ": ", std::strerror(err),
                             err == EEXIST ? " (it exists; open it with FileRouteStore::append to add routes, or "
                                             "choose a new name)"
                                           : ""));
  }

  [[noreturn]] static void throw_open_error(const std::filesystem::path& path) {
    const int err = errno;
    if (const std::string link = broken_symlink(path); !link.empty())
      throw RouteFileError(str("cannot open route file ", path.string(), ": it ", link));
    if (err == ENOENT) throw RouteFileError(str("route file ", path.string(), " does not exist"));
    throw RouteFileError(str("cannot open route file ", path.string(), ": ", std::strerror(err)));
  }

  UniqueFd fd_;
  std::filesystem::path path_;
  std::filesystem::path absolute_path_;  // a writer's path, for check_still_ours
  std::pair<dev_t, ino_t> identity_{};   // a writer's file
  bool writable_ = false;
  HeaderBytes header_{};
  bool name_unsynced_ = false;  // created by this handle; its directory not synced since
  std::string sync_error_;      // the first failed sync's message: every later sync fails with it
};

}  // namespace detail
MRR_NAMESPACE_END
