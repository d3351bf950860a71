#include "nvme_loader/py_lib/nvme_loader_py.h"

namespace maximus_nvme {
namespace {

void check_tensor(const torch::Tensor& t, const char* fn) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), fn, ": the tensor must be on the CPU (got ", t.device(),
                    "); use read_to_device() for GPU tensors");
  TORCH_CHECK_VALUE(t.is_contiguous(), fn, ": the tensor must be contiguous; call .contiguous() first");
}

std::shared_ptr<void> keep(const torch::Tensor& t) { return std::make_shared<torch::Tensor>(t); }

}  // namespace

std::shared_ptr<IOHandlePy> LoaderPy::read_into(const std::string& path, int64_t offset, const torch::Tensor& tensor) {
  check_tensor(tensor, "read_into");
  char* data = static_cast<char*>(tensor.data_ptr());
  return std::make_shared<IOHandlePy>(
      engine_->submit(OpKind::kRead, path, offset, data, tensor.nbytes(), false, keep(tensor)));
}

std::shared_ptr<IOHandlePy> LoaderPy::write_from(const torch::Tensor& tensor, const std::string& path, int64_t offset,
                                                 bool fsync) {
  check_tensor(tensor, "write_from");
  char* data = static_cast<char*>(tensor.data_ptr());
  return std::make_shared<IOHandlePy>(
      engine_->submit(OpKind::kWrite, path, offset, data, tensor.nbytes(), fsync, keep(tensor)));
}

}  // namespace maximus_nvme
