// The only PYBIND11_MODULE of the maximus_nvme_loader op.
#include <torch/extension.h>

#include "nvme_loader/py_lib/nvme_loader_py.h"

namespace py = pybind11;
using maximus_nvme::IOHandlePy;
using maximus_nvme::LoaderPy;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "maximus async NVMe loader: thread-pool pread/pwrite with O_DIRECT";
  m.attr("ALIGN_BYTES") = maximus_nvme::kAlign;
  m.attr("SHORT_READ_ERRNO") = maximus_nvme::kShortRead;

  py::class_<IOHandlePy, std::shared_ptr<IOHandlePy>>(m, "IOHandle")
      .def("wait", &IOHandlePy::wait, py::arg("timeout_s") = -1.0, py::call_guard<py::gil_scoped_release>(),
           "Block until done (or timeout_s > 0 passed); returns done().")
      .def("done", &IOHandlePy::done)
      .def("error_code", &IOHandlePy::error_code)
      .def("error_offset", &IOHandlePy::error_offset)
      .def("error_message", &IOHandlePy::error_message)
      .def("used_direct", &IOHandlePy::used_direct)
      .def_property_readonly("path", &IOHandlePy::path)
      .def_property_readonly("offset", &IOHandlePy::offset)
      .def_property_readonly("nbytes", &IOHandlePy::nbytes);

  py::class_<LoaderPy, std::shared_ptr<LoaderPy>>(m, "Loader")
      .def(py::init<int, int64_t, int, bool>(), py::arg("threads") = 8, py::arg("block_bytes") = 1 << 20,
           py::arg("queue_depth") = 32, py::arg("o_direct") = true)
      .def("read_into", &LoaderPy::read_into, py::arg("path"), py::arg("offset"), py::arg("tensor"))
      .def("write_from", &LoaderPy::write_from, py::arg("tensor"), py::arg("path"), py::arg("offset"),
           py::arg("fsync") = false)
      .def("close", &LoaderPy::close, py::arg("cancel") = false, py::call_guard<py::gil_scoped_release>())
      .def("closed", &LoaderPy::closed)
      .def("pending_pieces", &LoaderPy::pending_pieces)
      .def("take_messages", &LoaderPy::take_messages)
      .def_property_readonly("threads", &LoaderPy::threads)
      .def_property_readonly("block_bytes", &LoaderPy::block_bytes)
      .def_property_readonly("queue_depth", &LoaderPy::queue_depth)
      .def_property_readonly("o_direct", &LoaderPy::o_direct);
}
