// kiln_engine::{open, call_spec, run, close}: a CPU plan's compiled engine (AOTInductor's
// model .so) called through the dispatcher, so that a Python caller holds no GIL while the step
// runs. torch's AOTIModelPackageLoader.boxed_run keeps the GIL for the whole call: in `kiln
// serve` the event loop and the post thread then could run no Python during a step, only
// between steps, where they took turns on the GIL with the engine thread's own Python. Calls of
// torch.ops release the GIL; these ops run the same AOTIModelContainerRunnerCpu the package
// loader would create, on the model .so the runtime unpacked from the verified plan.
//
// The inputs come from Python, each tensor with its Python object. torch keeps that object alive
// while C++ holds a second reference, and decrefs it, taking the GIL, when the C++ count drops
// back to one (c10/util/intrusive_ptr.h, "PyObject preservation"). AOTInductor's model frees each
// input handle after its last use, in the middle of the step: the step took the GIL once per
// input (67 times in a SmolLM2 step), and waited each time a serving thread held it (`perf`
// sched_switch on the engine thread: 93% of its switches in take_gil under
// aoti_torch_delete_tensor_object). `run` holds one more reference to every input for the whole
// step and drops them all after it, under one acquisition of the GIL.
//
// A plan whose weights are a file of their own (runtime/weights.py maps it) hands them to the
// engine with `load_constants`: tensors over the read-only mapping, given to the runner as user
// managed constants, so that no byte is copied and the pages stay the page cache's, shared by
// every process that maps the plan. (torch 2.13's container keeps one extra reference to each
// user-managed tensor that it never drops; the Python side therefore unmaps the file itself once
// the engine is closed, rather than waiting for the tensors to be freed.)
//
// Engines live in a process-wide table (an int handle per open; close frees the runner, its
// weights and the .so mapping). A handle's runs may come from one thread at a time (the engine
// thread); the table itself is guarded. (open_engine and close_engine: Python.h declares ::close.)
#include <Python.h>
#include <torch/csrc/inductor/aoti_runner/model_container_runner_cpu.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

extern "C" __attribute__((used, visibility("default")))
const char kiln_engine_call_kernel_path[] = "KILN_KERNEL_PATH:engine call: aoti cpu runner, no GIL";

namespace {

using Runner = torch::inductor::AOTIModelContainerRunnerCpu;

std::mutex table_mutex;
std::vector<std::shared_ptr<Runner>>& table() {
  static std::vector<std::shared_ptr<Runner>> engines;
  return engines;
}

std::shared_ptr<Runner> engine(int64_t handle) {
  std::lock_guard<std::mutex> lock(table_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(table().size()) && table()[handle],
              "kiln_engine: no open engine ", handle);
  return table()[handle];
}

int64_t open_engine(c10::string_view model_so) {
  auto runner = std::make_shared<Runner>(std::string(model_so), /*num_models=*/1,
                                         /*run_single_threaded=*/false);
  std::lock_guard<std::mutex> lock(table_mutex);
  table().push_back(std::move(runner));
  return static_cast<int64_t>(table().size()) - 1;
}

std::vector<std::string> call_spec(int64_t handle) { return engine(handle)->get_call_spec(); }

// Drops `tensors` holding the GIL once (their Python objects' decrefs then take it re-entrantly).
void release_with_gil(std::vector<at::Tensor>& tensors) {
  if (!Py_IsInitialized()) {
    tensors.clear();
    return;
  }
  PyGILState_STATE state = PyGILState_Ensure();
  tensors.clear();
  PyGILState_Release(state);
}

std::vector<at::Tensor> run(int64_t handle, std::vector<at::Tensor> inputs) {
  std::vector<at::Tensor> held(inputs);   // the step's frees now never drop a count to one
  std::vector<at::Tensor> outputs = engine(handle)->boxed_run(std::move(inputs));
  release_with_gil(held);
  return outputs;
}

// The weights by their fully qualified names (fqns[i] names tensors[i]); every constant of the
// model must be among them. The tensors must outlive the engine (the caller keeps them).
void load_constants(int64_t handle, std::vector<std::string> fqns, std::vector<at::Tensor> tensors) {
  TORCH_CHECK(fqns.size() == tensors.size(), "kiln_engine: ", fqns.size(), " names for ",
              tensors.size(), " tensors");
  auto runner = engine(handle);
  std::unordered_map<std::string, std::string> by_fqn;
  for (const auto& [name, fqn] : runner->getConstantNamesToOriginalFQNs()) by_fqn[fqn] = name;
  std::unordered_map<std::string, at::Tensor> constants;
  for (size_t i = 0; i < fqns.size(); ++i) {
    auto it = by_fqn.find(fqns[i]);
    TORCH_CHECK(it != by_fqn.end(), "kiln_engine: the engine has no constant ", fqns[i]);
    constants.emplace(it->second, tensors[i]);
  }
  runner->update_constant_buffer(constants, /*use_inactive=*/false,
                                 /*validate_full_updates=*/true, /*user_managed=*/true);
}

void close_engine(int64_t handle) {
  std::shared_ptr<Runner> gone;
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    if (handle >= 0 && handle < static_cast<int64_t>(table().size())) gone.swap(table()[handle]);
  }
}

}  // namespace

TORCH_LIBRARY(kiln_engine, m) {
  m.def("open(str model_so) -> int", &open_engine);
  m.def("call_spec(int engine) -> str[]", &call_spec);
  m.def("run(int engine, Tensor[] inputs) -> Tensor[]", &run);
  m.def("load_constants(int engine, str[] fqns, Tensor[] tensors) -> ()", &load_constants);
  m.def("close(int engine) -> ()", &close_engine);
}
