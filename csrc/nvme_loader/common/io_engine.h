// Async file I/O engine of the maximus NVMe loader: a thread pool doing pread/pwrite, with O_DIRECT
// on 4096-aligned buffers where the file system allows it. No torch headers here (see py_lib/).
//
// A request (read or write of `nbytes` bytes at file `offset`) is split at `block_bytes` boundaries of
// the file into pieces; worker threads run the pieces, at most `queue_depth` at once. Under O_DIRECT a
// piece whose memory, offset or length is not 4096-aligned is bounced through the worker's own aligned
// buffer (reads read the covering aligned range; writes write the unaligned head/tail bytes buffered).
// Where open(O_DIRECT) is refused (EINVAL, e.g. ramfs) the request falls back to buffered I/O and the
// engine queues a message saying so (drained by take_messages()).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

namespace maximus_nvme {

constexpr int64_t kAlign = 4096;  // bytes; O_DIRECT alignment of offsets, lengths and addresses

enum class OpKind { kRead, kWrite };

// Error codes beyond errno: a read that ends before nbytes because the file is shorter.
constexpr int kShortRead = 61;  // ENODATA on Linux

// One submitted request and its completion state. Shared between the engine and the caller's handle.
class Request {
 public:
  Request(OpKind kind, std::string path, int64_t offset, char* data, int64_t nbytes, bool fsync,
          std::shared_ptr<void> keepalive);

  // Blocks until every piece has finished (or timeout_s > 0 passed). Returns done().
  bool wait(double timeout_s = -1.0);
  bool done() const;

  int error_code() const;            // 0 when it succeeded (or is not done)
  int64_t error_offset() const;      // file offset where the first error happened
  std::string error_message() const;
  bool used_direct() const { return direct_.load(); }

  const OpKind kind;
  const std::string path;
  const int64_t offset;
  char* const data;
  const int64_t nbytes;
  const bool fsync;

 private:
  friend class Engine;
  void fail(int err, int64_t at, const std::string& msg);  // first error (lowest offset) wins
  void piece_finished();                                    // closes files after the last piece
  bool failed() const { return err_.load() != 0; }

  std::shared_ptr<void> keepalive_;  // keeps the caller's memory alive while pieces run
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int64_t pieces_left_ = 0;
  bool done_ = false;
  std::atomic<int> err_{0};
  int64_t err_offset_ = 0;
  std::string err_msg_;
  // files, opened by the first worker that runs a piece
  std::mutex open_mu_;
  bool opened_ = false;
  int fd_direct_ = -1;
  int fd_buffered_ = -1;
  std::atomic<bool> direct_{false};
};

struct Piece {
  std::shared_ptr<Request> req;
  int64_t file_offset;
  int64_t mem_offset;
  int64_t len;
};

class Engine {
 public:
  Engine(int threads, int64_t block_bytes, int queue_depth, bool o_direct);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request; never blocks on I/O. Throws std::runtime_error when the engine is closed.
  std::shared_ptr<Request> submit(OpKind kind, const std::string& path, int64_t offset, char* data,
                                  int64_t nbytes, bool fsync, std::shared_ptr<void> keepalive);

  // Stops the engine: cancel=false runs everything queued first; cancel=true fails queued pieces with
  // ECANCELED and waits only for the pieces already running. Idempotent.
  void close(bool cancel);

  int64_t pending_pieces() const;           // queued + running
  std::vector<std::string> take_messages();  // fallback notices since the last call
  bool closed() const { return closed_.load(); }
  // True in a child forked after the engine started: its workers, mutex and condvar belong to the
  // parent. Such an engine must be leaked, not destroyed (see LoaderPy::~LoaderPy).
  bool forked() const { return ::getpid() != owner_pid_; }

  const int threads;
  const int64_t block_bytes;
  const int queue_depth;
  const bool o_direct;

 private:
  void worker_loop();
  void run_piece(const Piece& p, char* bounce);
  bool open_files(Request& r);
  int buffered_fd(Request& r);
  void note(const std::string& msg);

  const int owner_pid_;  // process that started the workers (they do not survive fork())
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Piece> queue_;
  int running_ = 0;
  std::atomic<bool> closed_{false};
  bool stopping_ = false;
  std::vector<std::thread> workers_;
  std::mutex msg_mu_;
  std::vector<std::string> messages_;
  std::vector<std::string> noted_paths_;
};

}  // namespace maximus_nvme
