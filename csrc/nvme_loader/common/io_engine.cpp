// Thread-pool pread/pwrite engine; see io_engine.h.
#include "nvme_loader/common/io_engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace maximus_nvme {
namespace {

int64_t align_down(int64_t x) { return x / kAlign * kAlign; }
int64_t align_up(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
bool aligned(int64_t x) { return x % kAlign == 0; }
bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kAlign == 0; }

// Reads up to n bytes; returns the count read (short only at end of file) or -errno.
int64_t pread_full(int fd, char* buf, int64_t n, int64_t off, bool direct) {
  int64_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, buf + got, static_cast<size_t>(n - got), off + got);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (r == 0) break;
    got += r;
    if (direct && !aligned(got)) break;  // O_DIRECT returns a partial block only at end of file
  }
  return got;
}

// Writes all n bytes; returns 0 or -errno.
int pwrite_full(int fd, const char* buf, int64_t n, int64_t off) {
  int64_t put = 0;
  while (put < n) {
    ssize_t r = ::pwrite(fd, buf + put, static_cast<size_t>(n - put), off + put);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (r == 0) return -EIO;
    put += r;
  }
  return 0;
}

struct AlignedFree {
  void operator()(char* p) const { std::free(p); }
};

}  // namespace

// ---------------------------------------------------------------- Request

Request::Request(OpKind kind_, std::string path_, int64_t offset_, char* data_, int64_t nbytes_, bool fsync_,
                 std::shared_ptr<void> keepalive)
    : kind(kind_), path(std::move(path_)), offset(offset_), data(data_), nbytes(nbytes_), fsync(fsync_),
      keepalive_(std::move(keepalive)) {}

bool Request::wait(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout_s < 0) {
    cv_.wait(lk, [&] { return done_; });
  } else {
    cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return done_; });
  }
  return done_;
}

bool Request::done() const {
  std::lock_guard<std::mutex> lk(mu_);
  return done_;
}

int Request::error_code() const { return err_.load(); }

int64_t Request::error_offset() const {
  std::lock_guard<std::mutex> lk(mu_);
  return err_offset_;
}

std::string Request::error_message() const {
  std::lock_guard<std::mutex> lk(mu_);
  return err_msg_;
}

void Request::fail(int err, int64_t at, const std::string& msg) {
  std::lock_guard<std::mutex> lk(mu_);
  // the first error wins; among errors of the same kind, the one at the lowest file offset (deterministic)
  int cur = err_.load();
  if (cur != 0 && (cur != err || at >= err_offset_)) return;
  err_offset_ = at;
  err_msg_ = msg;
  err_.store(err);
}

void Request::piece_finished() {
  std::shared_ptr<void> drop;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (--pieces_left_ > 0) return;
  }
  int fd_any = fd_direct_ >= 0 ? fd_direct_ : fd_buffered_;
  if (fsync && fd_any >= 0 && !failed() && ::fsync(fd_any) != 0) {
    int e = errno;
    fail(e, offset, std::string("fsync of ") + path + " failed: " + std::strerror(e));
  }
  if (fd_direct_ >= 0) ::close(fd_direct_);
  if (fd_buffered_ >= 0) ::close(fd_buffered_);
  fd_direct_ = fd_buffered_ = -1;
  {
    std::lock_guard<std::mutex> lk(mu_);
    done_ = true;
    drop.swap(keepalive_);
  }
  cv_.notify_all();
}

// ---------------------------------------------------------------- Engine

Engine::Engine(int threads_, int64_t block_bytes_, int queue_depth_, bool o_direct_)
    : threads(threads_), block_bytes(block_bytes_), queue_depth(queue_depth_), o_direct(o_direct_),
      owner_pid_(::getpid()) {
  if (threads < 1 || queue_depth < 1 || block_bytes < kAlign || block_bytes % kAlign != 0) {
    throw std::invalid_argument("maximus_nvme::Engine: need threads >= 1, queue_depth >= 1 and block_bytes a "
                                "positive multiple of 4096");
  }
  workers_.reserve(threads);
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

Engine::~Engine() { close(/*cancel=*/true); }

std::shared_ptr<Request> Engine::submit(OpKind kind, const std::string& path, int64_t offset, char* data,
                                        int64_t nbytes, bool fsync, std::shared_ptr<void> keepalive) {
  if (offset < 0 || nbytes < 0) throw std::invalid_argument("offset and nbytes must be >= 0");
  if (forked()) throw std::runtime_error("this loader's worker threads do not exist after fork()");
  auto req = std::make_shared<Request>(kind, path, offset, data, nbytes, fsync, std::move(keepalive));
  std::vector<Piece> pieces;
  for (int64_t pos = offset, end = offset + nbytes; pos < end;) {
    int64_t next = std::min(end, (pos / block_bytes + 1) * block_bytes);  // split at block boundaries of the file
    pieces.push_back(Piece{req, pos, pos - offset, next - pos});
    pos = next;
  }
  if (pieces.empty()) {  // nothing to move; a write still creates the file
    pieces.push_back(Piece{req, offset, 0, 0});
  }
  req->pieces_left_ = static_cast<int64_t>(pieces.size());
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) throw std::runtime_error("the NVMe loader is closed");
    for (auto& p : pieces) queue_.push_back(std::move(p));
  }
  cv_.notify_all();
  return req;
}

void Engine::close(bool cancel) {
  if (forked()) {  // the parent's workers do not exist here and their mutex/condvar state is stale
    closed_.store(true);
    return;
  }
  std::deque<Piece> dropped;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_ && workers_.empty()) return;
    stopping_ = true;
    if (cancel) dropped.swap(queue_);
  }
  cv_.notify_all();
  for (auto& p : dropped) {
    p.req->fail(ECANCELED, p.file_offset, "cancelled: the loader was closed with this request in flight");
    p.req->piece_finished();
  }
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
  workers_.clear();
  closed_.store(true);
}

int64_t Engine::pending_pieces() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(queue_.size()) + running_;
}

std::vector<std::string> Engine::take_messages() {
  std::lock_guard<std::mutex> lk(msg_mu_);
  std::vector<std::string> out;
  out.swap(messages_);
  return out;
}

void Engine::note(const std::string& msg) {
  std::lock_guard<std::mutex> lk(msg_mu_);
  messages_.push_back(msg);
}

void Engine::worker_loop() {
  std::unique_ptr<char, AlignedFree> bounce;
  for (;;) {
    Piece p;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return (stopping_ && queue_.empty()) || (!queue_.empty() && running_ < queue_depth); });
      if (queue_.empty()) return;
      p = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    if (!bounce) {
      void* mem = nullptr;
      if (posix_memalign(&mem, kAlign, static_cast<size_t>(block_bytes + 2 * kAlign)) != 0) {
        p.req->fail(ENOMEM, p.file_offset, "could not allocate the aligned bounce buffer");
      }
      bounce.reset(static_cast<char*>(mem));
    }
    if (bounce) run_piece(p, bounce.get());
    p.req->piece_finished();
    {
      std::lock_guard<std::mutex> lk(mu_);
      --running_;
    }
    cv_.notify_all();
  }
}

bool Engine::open_files(Request& r) {
  std::lock_guard<std::mutex> lk(r.open_mu_);
  if (r.opened_) return r.fd_direct_ >= 0 || r.fd_buffered_ >= 0;
  r.opened_ = true;
  int flags = (r.kind == OpKind::kRead ? O_RDONLY : (O_WRONLY | O_CREAT)) | O_CLOEXEC;
  if (o_direct) {
    r.fd_direct_ = ::open(r.path.c_str(), flags | O_DIRECT, 0644);
    if (r.fd_direct_ >= 0) {
      r.direct_.store(true);
      return true;
    }
    if (errno != EINVAL) {
      int e = errno;
      r.fail(e, r.offset, std::string("cannot open ") + r.path + ": " + std::strerror(e));
      return false;
    }
    std::string dir = r.path.substr(0, r.path.find_last_of('/') + 1);
    std::lock_guard<std::mutex> mk(msg_mu_);
    bool seen = false;
    for (auto& d : noted_paths_) seen = seen || d == dir;
    if (!seen) {
      noted_paths_.push_back(dir);
      messages_.push_back("O_DIRECT refused (EINVAL) for " + r.path + "; using buffered I/O for files in '" + dir +
                          "' (its file system does not support direct I/O)");
    }
  }
  r.fd_buffered_ = ::open(r.path.c_str(), flags, 0644);
  if (r.fd_buffered_ < 0) {
    int e = errno;
    r.fail(e, r.offset, std::string("cannot open ") + r.path + ": " + std::strerror(e));
    return false;
  }
  return true;
}

int Engine::buffered_fd(Request& r) {
  std::lock_guard<std::mutex> lk(r.open_mu_);
  if (r.fd_buffered_ < 0) {
    int flags = (r.kind == OpKind::kRead ? O_RDONLY : O_WRONLY) | O_CLOEXEC;
    r.fd_buffered_ = ::open(r.path.c_str(), flags);
  }
  return r.fd_buffered_ >= 0 ? r.fd_buffered_ : -errno;
}

void Engine::run_piece(const Piece& p, char* bounce) {
  Request& r = *p.req;
  if (r.failed() || !open_files(r) || p.len == 0) return;
  const bool direct = r.direct_.load();
  const int64_t off = p.file_offset, len = p.len, end = off + len;
  char* mem = r.data + p.mem_offset;
  const char* what = r.kind == OpKind::kRead ? "read" : "write";
  auto fail_errno = [&](int e, int64_t at) {
    r.fail(e, at, std::string(what) + " of " + r.path + " failed at byte " + std::to_string(at) + " (request [" +
                      std::to_string(r.offset) + ", " + std::to_string(r.offset + r.nbytes) + ")): " +
                      std::strerror(e));
  };

  if (r.kind == OpKind::kRead) {
    int64_t avail;
    if (!direct) {
      avail = pread_full(r.fd_buffered_, mem, len, off, false);
    } else if (aligned(off) && aligned(len) && aligned(mem)) {
      avail = pread_full(r.fd_direct_, mem, len, off, true);
    } else {  // read the covering aligned range into the bounce buffer
      int64_t a = align_down(off), z = align_up(end);
      int64_t got = pread_full(r.fd_direct_, bounce, z - a, a, true);
      avail = got < 0 ? got : std::min(len, std::max<int64_t>(0, got - (off - a)));
      if (avail > 0) std::memcpy(mem, bounce + (off - a), static_cast<size_t>(avail));
    }
    if (avail < 0) return fail_errno(static_cast<int>(-avail), off);
    if (avail < len) {
      r.fail(kShortRead, off + avail,
             "short read of " + r.path + ": the file ends at byte " + std::to_string(off + avail) +
                 " but bytes [" + std::to_string(r.offset) + ", " + std::to_string(r.offset + r.nbytes) +
                 ") were asked for (read past end of file)");
    }
    return;
  }

  // write
  if (!direct) {
    int rc = pwrite_full(r.fd_buffered_, mem, len, off);
    if (rc < 0) fail_errno(-rc, off);
    return;
  }
  int64_t a = align_up(off), z = align_down(end);
  if (a < z) {  // aligned middle through O_DIRECT (bounced when the memory is not aligned)
    const char* src = mem + (a - off);
    if (!aligned(src)) {
      std::memcpy(bounce, src, static_cast<size_t>(z - a));
      src = bounce;
    }
    int rc = pwrite_full(r.fd_direct_, src, z - a, a);
    if (rc < 0) return fail_errno(-rc, a);
  } else {
    a = z = end;  // nothing aligned: the whole piece is the "head"
  }
  // unaligned head [off, a) and tail [z, end) through the page cache
  if (a > off || z < end) {
    int fd = buffered_fd(r);
    if (fd < 0) return fail_errno(-fd, off);
    if (a > off) {
      int rc = pwrite_full(fd, mem, a - off, off);
      if (rc < 0) return fail_errno(-rc, off);
    }
    if (z < end) {
      int rc = pwrite_full(fd, mem + (z - off), end - z, z);
      if (rc < 0) return fail_errno(-rc, z);
    }
  }
}

}  // namespace maximus_nvme
