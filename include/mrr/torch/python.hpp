// mrr's exceptions as typed Python exceptions, for a pybind11 module (a torch extension): a
// trainer catches RouteFileError or ConfigError by type, reads mrr's message unchanged, and code
// that only knows Python's builtins still catches ValueError or RuntimeError.
//
//   PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { mrr::torch::register_exceptions(m); ... }
//
//   InvalidArgumentError(ValueError)  mrr::InvalidArgument
//   ConfigError(ValueError)           mrr::ConfigError
//   RouteStoreError(RuntimeError)     mrr::RouteStoreError
//   RouteFileError(RouteStoreError)   mrr::RouteFileError
//   CommunicatorError(RuntimeError)   mrr::CommunicatorError
//   PeerRankError(RuntimeError)       mrr::PeerRankError (its .rank is the failing rank)
//
// An optional header like the rest of mrr/torch: include it only where pybind11 is available.
// mrr-requires: mrr_torch
// (a target mrr's own build never defines: the torch tests compile these headers, ctest -L torch)
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

#include <torch/extension.h>

#include <exception>
#include <string>

MRR_NAMESPACE_BEGIN
namespace torch {

namespace detail {

// The Python classes, created once per process by register_exceptions. They are deliberately
// never released: a translator is a plain function pointer (no captures), and static
// pybind11::object members would be destroyed after the interpreter is finalized.
struct PythonExceptionTypes {
  PyObject* invalid_argument = nullptr;
  PyObject* config = nullptr;
  PyObject* route_store = nullptr;
  PyObject* route_file = nullptr;
  PyObject* communicator = nullptr;
  PyObject* peer_rank = nullptr;
};

inline PythonExceptionTypes& python_exception_types() {
  static PythonExceptionTypes types;
  return types;
}

// A new exception class `name` deriving from `base`, bound as module attribute `name`.
inline PyObject* new_exception_type(pybind11::module_& m, const char* name, PyObject* base, const char* doc) {
  const std::string qualified = m.attr("__name__").cast<std::string>() + "." + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, base, nullptr);
  if (type == nullptr) throw pybind11::error_already_set();
  m.attr(name) = pybind11::handle(type);  // the module holds its own reference; ours stays
  return type;
}

inline void set_python_error(PyObject* type, const char* what) { PyErr_SetString(type, what); }

// PeerRankError carries the rank that failed, as the C++ exception does.
inline void set_peer_rank_error(PyObject* type, const PeerRankError& e) {
  pybind11::object error = pybind11::reinterpret_borrow<pybind11::object>(type)(e.what());
  error.attr("rank") = e.rank();
  PyErr_SetObject(type, error.ptr());
}

}  // namespace detail

// Adds the exception classes to `m` and translates mrr's exceptions thrown by its functions.
// Derived types are caught before their bases (RouteFileError before RouteStoreError); anything
// else falls through to pybind11's and torch's own translators.
inline void register_exceptions(pybind11::module_& m) {
  auto& t = detail::python_exception_types();
  t.invalid_argument = detail::new_exception_type(
      m, "InvalidArgumentError", PyExc_ValueError,
      "An argument mrr cannot use: a shape or dtype mismatch, an expert id out of range, a NaN logit.");
  t.config = detail::new_exception_type(m, "ConfigError", PyExc_ValueError,
                                        "An unknown or inconsistent router-replay configuration key or value.");
  t.route_store = detail::new_exception_type(
      m, "RouteStoreError", PyExc_RuntimeError,
      "A route store could not answer: a missing route, a conflicting re-record, a shape mismatch.");
  t.route_file = detail::new_exception_type(m, "RouteFileError", t.route_store,
                                            "A route file is missing, damaged, locked, or of another model.");
  t.communicator = detail::new_exception_type(m, "CommunicatorError", PyExc_RuntimeError,
                                              "A collective failed (another rank failed, or the transport did).");
  t.peer_rank = detail::new_exception_type(m, "PeerRankError", PyExc_RuntimeError,
                                           "Another rank of the group failed; .rank is the rank that failed.");

  pybind11::register_exception_translator([](std::exception_ptr p) {
    const auto& types = detail::python_exception_types();
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      detail::set_python_error(types.invalid_argument, e.what());
    } catch (const ConfigError& e) {
      detail::set_python_error(types.config, e.what());
    } catch (const RouteFileError& e) {
      detail::set_python_error(types.route_file, e.what());
    } catch (const RouteStoreError& e) {
      detail::set_python_error(types.route_store, e.what());
    } catch (const CommunicatorError& e) {
      detail::set_python_error(types.communicator, e.what());
    } catch (const PeerRankError& e) {
      detail::set_peer_rank_error(types.peer_rank, e);
    }
  });
}

}  // namespace torch
MRR_NAMESPACE_END
