// torch glue of the NVMe loader: submits reads/writes of CPU tensors to the common/ engine.
#pragma once

#include <torch/extension.h>

#include <memory>
#include <string>
#include <vector>

#include "nvme_loader/common/io_engine.h"

namespace maximus_nvme {

// Completion handle returned to Python (wait() releases the GIL in bindings.cpp).
class IOHandlePy {
 public:
  explicit IOHandlePy(std::shared_ptr<Request> req) : req_(std::move(req)) {}
  bool wait(double timeout_s) { return req_->wait(timeout_s); }
  bool done() const { return req_->done(); }
  int error_code() const { return req_->error_code(); }
  int64_t error_offset() const { return req_->error_offset(); }
  std::string error_message() const { return req_->error_message(); }
  bool used_direct() const { return req_->used_direct(); }
  std::string path() const { return req_->path; }
  int64_t offset() const { return req_->offset; }
  int64_t nbytes() const { return req_->nbytes; }

 private:
  std::shared_ptr<Request> req_;
};

class LoaderPy {
 public:
  LoaderPy(int threads, int64_t block_bytes, int queue_depth, bool o_direct)
      : engine_(new Engine(threads, block_bytes, queue_depth, o_direct)) {}
  ~LoaderPy() {
    if (engine_->forked()) (void)engine_.release();  // destroying it would wait on the parent's threads
  }

  // Fills `tensor` (contiguous CPU) with tensor.nbytes() bytes of `path` starting at `offset`.
  std::shared_ptr<IOHandlePy> read_into(const std::string& path, int64_t offset, const torch::Tensor& tensor);
  // Writes tensor's bytes to `path` at `offset` (creating the file); fsync before completion if asked.
  std::shared_ptr<IOHandlePy> write_from(const torch::Tensor& tensor, const std::string& path, int64_t offset,
                                         bool fsync);
  void close(bool cancel) { engine_->close(cancel); }
  bool closed() const { return engine_->closed(); }
  int64_t pending_pieces() const { return engine_->pending_pieces(); }
  std::vector<std::string> take_messages() { return engine_->take_messages(); }
  int threads() const { return engine_->threads; }
  int64_t block_bytes() const { return engine_->block_bytes; }
  int queue_depth() const { return engine_->queue_depth; }
  bool o_direct() const { return engine_->o_direct; }

 private:
  std::unique_ptr<Engine> engine_;
};

}  // namespace maximus_nvme
