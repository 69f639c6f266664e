// A loaded AOTInductor package, called without Python's GIL: package_call_cpu.py defines the ops'
// use and documents why. torch's own Python binding of AOTIModelPackageLoader::boxed_run holds the
// GIL for the whole call, so while a layer piece runs no other Python thread of the process (the
// server's HTTP loop, /metrics, /health, other streams) can run; a call through the dispatcher
// releases it, as every torch op does.
//
// Loaded packages live in a table of this library, named by an int handle, until closed.

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using Loader = torch::inductor::AOTIModelPackageLoader;

std::mutex table_mutex;
std::unordered_map<int64_t, std::shared_ptr<Loader>> table;
int64_t next_handle = 0;

std::shared_ptr<Loader> find(int64_t handle) {
  std::lock_guard<std::mutex> lock(table_mutex);
  auto it = table.find(handle);
  TORCH_CHECK(it != table.end(), "no open package has handle ", handle);
  return it->second;
}

int64_t package_open(std::string path, int64_t device_index) {
  auto loader = std::make_shared<Loader>(path, "model", false, 1, static_cast<c10::DeviceIndex>(device_index));
  std::lock_guard<std::mutex> lock(table_mutex);
  table.emplace(next_handle, std::move(loader));
  return next_handle++;
}

void package_close(int64_t handle) {
  std::lock_guard<std::mutex> lock(table_mutex);
  table.erase(handle);
}

std::vector<std::string> package_call_spec(int64_t handle) { return find(handle)->get_call_spec(); }

std::vector<at::Tensor> package_run(int64_t handle, std::vector<at::Tensor> inputs) {
  return find(handle)->boxed_run(std::move(inputs));
}

}  // namespace

// The schemas are package_call_cpu.py's; no tensor decides these kernels, so they serve every key.
TORCH_LIBRARY_IMPL(nb, CompositeImplicitAutograd, m) {
  m.impl("package_open", &package_open);
  m.impl("package_close", &package_close);
  m.impl("package_call_spec", &package_call_spec);
  m.impl("package_run", &package_run);
}
