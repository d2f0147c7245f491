// testdev: a PrivateUse1 device that is not the CPU, for polytrain's device tier.
//
// Its memory is host memory the host may not read: every allocation is its own mmap kept
// PROT_NONE except while one of this file's copies runs, so a host read of device memory (a
// kernel that forgot to move a tensor) crashes at once. Compute runs through CPU kernels (a
// boxed fallback that copies arguments to the host and results back), after checking, as CUDA
// does, that all tensor arguments are on one device. N devices per process, a thread-local
// current device, synchronous streams, events that record host time, per-device generators,
// a pinned host allocator, autocast rules, and a collective backend ("testccl") that stages
// device tensors through host copies around an inner gloo group.

#include <torch/extension.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <type_traits>

namespace testdev {

using c10::DeviceIndex;
using c10::DeviceType;
constexpr DeviceIndex kMaxDevices = 8;
constexpr DeviceType kDev = DeviceType::PrivateUse1;

DeviceIndex g_device_count = 2;
bool g_guard = true;  // false: device memory stays readable (to debug a crash)
thread_local DeviceIndex t_current = 0;
thread_local std::array<c10::StreamId, kMaxDevices> t_stream{};

void check_index(DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < g_device_count, "testdev: invalid device ordinal ", int(index),
              " (this process has ", int(g_device_count), " testdev devices)");
}

// Makes `index` the current device for a scope (allocation happens on the current device).
struct OnDevice {
  DeviceIndex previous;
  explicit OnDevice(DeviceIndex index) : previous(t_current) {
    check_index(index);
    t_current = index;
  }
  ~OnDevice() { t_current = previous; }
};

// ---------------------------------------------------------------- guarded device memory

struct Region {
  size_t mapped;
  DeviceIndex device;
  int open = 0;  // copies reading or writing it now
};

std::mutex g_mutex;
std::map<uintptr_t, Region> g_regions;  // by base address
struct Counters {
  int64_t allocated = 0, peak = 0;
};
std::array<Counters, kMaxDevices> g_counters;

size_t page_round(size_t n) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

// The region holding `address`, or nullptr (caller holds g_mutex).
Region* region_of(const void* address, uintptr_t* base = nullptr) {
  auto p = reinterpret_cast<uintptr_t>(address);
  auto it = g_regions.upper_bound(p);
  if (it == g_regions.begin()) return nullptr;
  --it;
  if (p >= it->first + it->second.mapped) return nullptr;
  if (base) *base = it->first;
  return &it->second;
}

void release(void* address) {
  if (!address) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_regions.find(reinterpret_cast<uintptr_t>(address));
  TORCH_INTERNAL_ASSERT(it != g_regions.end(), "testdev: freeing memory it did not allocate");
  g_counters[it->second.device].allocated -= static_cast<int64_t>(it->second.mapped);
  munmap(address, it->second.mapped);
  g_regions.erase(it);
}

// Opens device memory to the host for the life of the object (this file's copies only).
class HostAccess {
 public:
  void open(const at::Tensor& t) {
    if (!t.defined() || t.device().type() != kDev || !t.has_storage()) return;
    open_address(t.storage().data());
  }
  void open_address(const void* address) {
    if (!address) return;
    std::lock_guard<std::mutex> lock(g_mutex);
    uintptr_t base = 0;
    Region* region = region_of(address, &base);
    if (!region) return;
    if (region->open++ == 0 && g_guard)
      mprotect(reinterpret_cast<void*>(base), region->mapped, PROT_READ | PROT_WRITE);
    opened_.push_back(base);
  }
  ~HostAccess() {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (uintptr_t base : opened_) {
      Region& region = g_regions.at(base);
      if (--region.open == 0 && g_guard)
        mprotect(reinterpret_cast<void*>(base), region.mapped, PROT_NONE);
    }
  }

 private:
  std::vector<uintptr_t> opened_;
};

struct DeviceMemory final : c10::DeviceAllocator {
  at::DataPtr allocate(size_t n) override {
    DeviceIndex device = t_current;
    c10::Device where(kDev, device);
    if (n == 0) return {nullptr, nullptr, &release, where};
    size_t mapped = page_round(n);
    void* address = mmap(nullptr, mapped, g_guard ? PROT_NONE : PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(address != MAP_FAILED, "testdev: out of memory allocating ", n, " bytes");
    std::lock_guard<std::mutex> lock(g_mutex);
    g_regions[reinterpret_cast<uintptr_t>(address)] = Region{mapped, device};
    Counters& c = g_counters[device];
    c.allocated += static_cast<int64_t>(mapped);
    c.peak = std::max(c.peak, c.allocated);
    return {address, address, &release, where};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    HostAccess access;
    access.open_address(dest);
    access.open_address(src);
    std::memcpy(dest, src, count);
  }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}
  void recordStream(const at::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(g_mutex);
    c10::CachingDeviceAllocator::DeviceStats stats;
    for (auto* stat : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes}) {
      (*stat)[0].current = g_counters[device].allocated;
      (*stat)[0].peak = g_counters[device].peak;
    }
    return stats;
  }
  void resetAccumulatedStats(DeviceIndex) override {}
  void resetPeakStats(DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(g_mutex);
    g_counters[device].peak = g_counters[device].allocated;
  }
};

DeviceMemory g_memory;
REGISTER_ALLOCATOR(kDev, &g_memory);

at::DataPtr allocate_on(DeviceIndex device, size_t n) {
  OnDevice on(device);
  return g_memory.allocate(n);
}

// Page-locked host memory stand-in: ordinary host memory the hooks report as pinned.
std::mutex g_pinned_mutex;
std::map<uintptr_t, size_t> g_pinned;

void release_pinned(void* address) {
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  g_pinned.erase(reinterpret_cast<uintptr_t>(address));
  std::free(address);
}

struct PinnedMemory final : c10::Allocator {
  at::DataPtr allocate(size_t n) override {
    void* address = std::malloc(std::max<size_t>(n, 1));
    TORCH_CHECK(address, "testdev: out of pinned host memory");
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    g_pinned[reinterpret_cast<uintptr_t>(address)] = n;
    return {address, address, &release_pinned, c10::Device(DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};
PinnedMemory g_pinned_memory;

bool is_pinned(const void* address) {
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  auto p = reinterpret_cast<uintptr_t>(address);
  auto it = g_pinned.upper_bound(p);
  if (it == g_pinned.begin()) return false;
  --it;
  return p < it->first + std::max<size_t>(it->second, 1);
}

// ---------------------------------------------------------------- device guard, streams, events

struct Event {
  double host_ms = 0;
  bool timing = false;
  bool recorded = false;
};

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

struct Guard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return kDev; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {kDev, t_current}; }
  void setDevice(c10::Device d) const override {
    check_index(d.index());
    t_current = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { t_current = d.index(); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, t_stream[d.index()]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream getNewStream(c10::Device d, int) const override {
    static std::atomic<c10::StreamId> next{1};
    return c10::Stream(c10::Stream::UNSAFE, d, next++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device());
    t_stream[s.device_index()] = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return g_device_count; }
  // Work is synchronous, so an event completes when recorded; it keeps the host time for
  // elapsed_time, and (as CUDA) only when created with timing.
  void record(void** event, const c10::Stream&, const DeviceIndex, const c10::EventFlag flag) const override {
    if (!*event) *event = new Event{0, flag == c10::EventFlag::BACKEND_DEFAULT, false};
    auto* e = static_cast<Event*>(*event);
    e->host_ms = now_ms();
    e->recorded = true;
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override { delete static_cast<Event*>(event); }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* start, void* end, const DeviceIndex) const override {
    auto* a = static_cast<Event*>(start);
    auto* b = static_cast<Event*>(end);
    TORCH_CHECK(a && b && a->recorded && b->recorded,
                "Both events must be recorded before calculating elapsed time.");
    TORCH_CHECK(a->timing && b->timing,
                "Both events must be created with argument 'enable_timing=True'.");
    return b->host_ms - a->host_ms;
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// ---------------------------------------------------------------- generators

// A device generator: a CPU generator's algorithm and state under the device's name, so the
// CPU kernels the fallback runs can draw from it (they accept only CPU generators).
struct Generator final : c10::GeneratorImpl {
  c10::intrusive_ptr<at::CPUGeneratorImpl> host;
  explicit Generator(DeviceIndex index, c10::intrusive_ptr<at::CPUGeneratorImpl> state = {})
      : c10::GeneratorImpl(c10::Device(kDev, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        host(state ? std::move(state) : c10::make_intrusive<at::CPUGeneratorImpl>(c10::default_rng_seed_val)) {}
  void set_current_seed(uint64_t seed) override { host->set_current_seed(seed); }
  void set_offset(uint64_t offset) override { host->set_offset(offset); }
  uint64_t get_offset() const override { return host->get_offset(); }
  uint64_t current_seed() const override { return host->current_seed(); }
  uint64_t seed() override { return host->seed(); }
  void set_state(const c10::TensorImpl& state) override { host->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override { return host->get_state(); }
  Generator* clone_impl() const override {
    const c10::GeneratorImpl& base = *host;
    return new Generator(device().index(), c10::static_intrusive_pointer_cast<at::CPUGeneratorImpl>(base.clone()));
  }
};

const at::Generator& default_generator(DeviceIndex index) {
  static std::array<at::Generator, kMaxDevices> generators = [] {
    std::array<at::Generator, kMaxDevices> made;
    for (DeviceIndex i = 0; i < kMaxDevices; ++i) made[i] = at::make_generator<Generator>(i);
    return made;
  }();
  if (index < 0) index = t_current;
  check_index(index);
  return generators[index];
}

// ---------------------------------------------------------------- hooks

void resize_bytes(const c10::Storage& storage, size_t n) {
  size_t old = storage.nbytes();
  at::DataPtr fresh = allocate_on(storage.device().index(), n);
  if (old && n) {
    HostAccess access;
    access.open_address(fresh.get());
    access.open_address(storage.data());
    std::memcpy(fresh.get(), storage.data(), std::min(old, n));
  }
  storage.set_data_ptr_noswap(std::move(fresh));
  storage.set_nbytes(n);
}

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return g_device_count; }
  void setCurrentDevice(DeviceIndex d) const override {
    check_index(d);
    t_current = d;
  }
  DeviceIndex getCurrentDevice() const override { return t_current; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    DeviceIndex old = t_current;
    setCurrentDevice(d);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(DeviceIndex index) const override { return default_generator(index); }
  at::Generator getNewGenerator(DeviceIndex index) const override {
    return at::make_generator<Generator>(index < 0 ? t_current : index);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    std::lock_guard<std::mutex> lock(g_mutex);
    Region* region = region_of(data);
    TORCH_CHECK(region, "testdev: pointer is not testdev memory");
    return {kDev, region->device};
  }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_memory; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t n) const override { resize_bytes(storage, n); }
};

// ---------------------------------------------------------------- kernels of its own

// The host's view of a device tensor's memory (valid only inside a HostAccess).
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().type() != kDev) return t;
  return at::from_blob(const_cast<void*>(t.const_data_ptr()), t.sizes(), t.strides(),
                       t.options().device(DeviceType::CPU));
}

DeviceIndex device_of(std::optional<c10::Device> device) {
  return device && device->has_index() ? device->index() : t_current;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<c10::Device> device,
                               std::optional<bool>, std::optional<c10::MemoryFormat> format) {
  OnDevice on(device_of(device));
  return at::detail::empty_generic(size, &g_memory, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout>, std::optional<c10::Device> device, std::optional<bool>) {
  OnDevice on(device_of(device));
  return at::detail::empty_strided_generic(size, stride, &g_memory,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  if (self.numel() == 0) return dst;
  HostAccess access;
  access.open(self);
  access.open(dst);
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size, std::optional<c10::MemoryFormat>) {
  int64_t numel = c10::multiply_integers(size);
  size_t needed = static_cast<size_t>((numel + self.storage_offset()) * self.itemsize());
  if (numel && needed > self.storage().nbytes()) resize_bytes(self.storage(), needed);
  self.unsafeGetTensorImpl()->set_sizes_contiguous(size);
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.device().type() == kDev) resize_(dst, self.sizes(), std::nullopt);
  else dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(offset);
  if (stride.empty()) impl->set_sizes_contiguous(size);
  else impl->set_sizes_and_strides(size, stride);
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes()) / static_cast<int64_t>(self.itemsize());
  return set_storage(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, allocate_on(self.device().index(), 0), &g_memory, true);
  return set_storage(self, std::move(empty), 0, {0}, {});
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  HostAccess access;
  access.open(self);
  return at::_local_scalar_dense(host_alias(self).clone());
}

void record_stream(at::Tensor&, c10::Stream) {}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("record_stream", record_stream);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
}

// ---------------------------------------------------------------- everything else: CPU kernels

// Ops CUDA runs with host index tensors beside device ones.
bool takes_host_indices(const c10::OperatorName& name) {
  return name.name == "aten::index" || name.name == "aten::index_put_" || name.name == "aten::_index_put_impl_" ||
         name.name == "aten::index_put";
}

// CUDA's rule: every tensor argument on one device, except 0-dim host tensors read as scalars
// (a host tensor written by an op on device tensors is refused, whatever its shape).
void check_one_device(const c10::OperatorHandle& op, const torch::jit::Stack& stack, c10::Device* found) {
  const auto& arguments = op.schema().arguments();
  size_t first = stack.size() - arguments.size();
  std::optional<c10::Device> seen;
  bool exempt = takes_host_indices(op.schema().operator_name());
  auto visit = [&](const at::Tensor& t, const std::string& name, bool written) {
    if (!t.defined() || (t.device().is_cpu() && ((t.dim() == 0 && !written) || exempt))) return;
    if (!seen) {
      seen = t.device();
    } else if (*seen != t.device()) {
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but got ", name, " is on ", t.device(),
                  ", different from other tensors on ", *seen, " (when checking argument in method ",
                  op.schema().operator_name(), ")");
    }
  };
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& value = stack[first + i];
    const std::string& name = arguments[i].name();
    bool written = arguments[i].alias_info() && arguments[i].alias_info()->isWrite();
    if (value.isTensor()) {
      visit(value.toTensor(), name, written);
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorVector()) visit(t, name, written);
    } else if (value.isList()) {
      for (const c10::IValue& item : value.toListRef())
        if (item.isTensor()) visit(item.toTensor(), name, written);
    }
  }
  if (seen && seen->type() == kDev) *found = *seen;
}

// Random ops draw from the device's generator, never the CPU's.
void use_device_generator(const c10::OperatorHandle& op, torch::jit::Stack& stack, c10::Device device) {
  const auto& arguments = op.schema().arguments();
  size_t first = stack.size() - arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (arguments[i].type()->kind() != c10::TypeKind::OptionalType) continue;
    auto contained = arguments[i].type()->castRaw<c10::OptionalType>()->getElementType();
    if (contained->kind() != c10::TypeKind::GeneratorType) continue;
    c10::IValue& value = stack[first + i];
    at::Generator gen = value.isNone() ? default_generator(device.index()) : value.toGenerator();
    if (gen.device().type() == kDev) value = at::Generator(gen.get<Generator>()->host);
  }
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::Device device(kDev, t_current);
  check_one_device(op, *stack, &device);
  use_device_generator(op, *stack, device);
  OnDevice on(device.index());  // results land on the arguments' device
  at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

// ---------------------------------------------------------------- autocast

// Ops without a rule below run as they are.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  KERNEL_PRIVATEUSEONE(mm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(bmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(addmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(baddbmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(matmul, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(linear, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(scaled_dot_product_attention, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(softmax, int, fp32)
  KERNEL_PRIVATEUSEONE(log_softmax, int, fp32)
  KERNEL_PRIVATEUSEONE(layer_norm, fp32)
  KERNEL_PRIVATEUSEONE(rms_norm, fp32)
  KERNEL_PRIVATEUSEONE(nll_loss, fp32)
  KERNEL_PRIVATEUSEONE(cross_entropy_loss, fp32)
  KERNEL_PRIVATEUSEONE(mse_loss, fp32)
}

// ---------------------------------------------------------------- collectives: "testccl"

using Tensors = std::vector<at::Tensor>;

// A collective that has finished (they all run synchronously here).
class DoneWork final : public c10d::Work {
 public:
  explicit DoneWork(Tensors outputs) : outputs_(std::move(outputs)) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future_->markCompleted(c10::IValue(outputs_));
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  Tensors result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  Tensors outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A send or receive still under way: waiting finishes it (a receive copies into the device).
class PendingWork final : public c10d::Work {
 public:
  PendingWork(c10::intrusive_ptr<c10d::Work> inner, std::function<void()> finish)
      : inner_(std::move(inner)), finish_(std::move(finish)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    complete();
    return true;
  }
  bool isCompleted() override {
    if (inner_->isCompleted()) complete();
    return done_;
  }
  bool isSuccess() const override { return inner_->isSuccess(); }
  int sourceRank() const override { return inner_->sourceRank(); }

 private:
  void complete() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    if (finish_) finish_();
    done_ = true;
  }
  c10::intrusive_ptr<c10d::Work> inner_;
  std::function<void()> finish_;
  std::mutex mutex_;
  bool done_ = false;
};

at::Tensor to_host(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().type() == kDev, "testccl ", op, ": a tensor is on ", t.device(),
              ", not a testdev device (a device collective library such as NCCL takes device tensors only)");
  return t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
}

Tensors to_host(const Tensors& ts, const char* op) {
  Tensors host;
  for (const auto& t : ts) host.push_back(to_host(t, op));
  return host;
}

std::vector<Tensors> to_host(const std::vector<Tensors>& tss, const char* op) {
  std::vector<Tensors> host;
  for (const auto& ts : tss) host.push_back(to_host(ts, op));
  return host;
}

// Results back into the caller's device tensors, below autograd (a received leaf that requires
// grad would refuse an in-place write).
void back(const at::Tensor& device, const at::Tensor& host) {
  at::AutoDispatchBelowADInplaceOrView below;
  device.copy_(host);
}
void back(const Tensors& device, const Tensors& host) {
  for (size_t i = 0; i < device.size(); ++i) back(device[i], host[i]);
}
void back(const std::vector<Tensors>& device, const std::vector<Tensors>& host) {
  for (size_t i = 0; i < device.size(); ++i) back(device[i], host[i]);
}

// gloo has no average: sum, then divide by the group's size.
template <typename Options>
Options summing(const Options& opts) {
  Options sum = opts;
  if (sum.reduceOp.op_ == c10d::ReduceOp::AVG) sum.reduceOp = c10d::ReduceOp::SUM;
  return sum;
}
template <typename Options>
void average(const Options& opts, const Tensors& host, int size) {
  if (opts.reduceOp.op_ == c10d::ReduceOp::AVG)
    for (const auto& h : host) h.div_(size);
}

Tensors flat(const Tensors& ts) { return ts; }
Tensors flat(const at::Tensor& t) { return {t}; }
Tensors flat(const std::vector<Tensors>& tss) {
  Tensors all;
  for (const auto& ts : tss) all.insert(all.end(), ts.begin(), ts.end());
  return all;
}

class StagingBackend final : public c10d::Backend {
 public:
  StagingBackend(c10::intrusive_ptr<c10d::Backend> gloo, int rank, int size)
      : Backend(rank, size), gloo_(std::move(gloo)) {}
  const std::string getBackendName() const override { return "testccl"; }

  c10::intrusive_ptr<c10d::Work> broadcast(Tensors& ts, const c10d::BroadcastOptions& opts) override {
    return staged(ts, ts, "broadcast", [&](auto& o, auto&) { return gloo_->broadcast(o, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allreduce(Tensors& ts, const c10d::AllreduceOptions& opts) override {
    return staged(
        ts, ts, "all_reduce", [&](auto& o, auto&) { return gloo_->allreduce(o, summing(opts)); },
        [&](auto& o) { average(opts, o, getSize()); });
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(Tensors& ts, const c10d::AllreduceCoalescedOptions& opts) override {
    c10d::AllreduceOptions one;
    one.reduceOp = opts.reduceOp;
    one.timeout = opts.timeout;
    return allreduce(ts, one);
  }
  c10::intrusive_ptr<c10d::Work> reduce(Tensors& ts, const c10d::ReduceOptions& opts) override {
    return staged(ts, ts, "reduce", [&](auto& o, auto&) { return gloo_->reduce(o, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<Tensors>& outs, Tensors& ins,
                                           const c10d::AllgatherOptions& opts) override {
    return staged(outs, ins, "all_gather", [&](auto& o, auto& i) { return gloo_->allgather(o, i, opts); });
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& opts) override {
    return staged(out, in, "all_gather_into_tensor",
                  [&](auto& o, auto& i) { return gloo_->_allgather_base(o, i, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(Tensors& outs, Tensors& ins,
                                                                 const c10d::AllgatherOptions& opts) override {
    for (size_t i = 0; i < outs.size(); ++i) _allgather_base(outs[i], ins[i], opts);
    return done(outs);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<Tensors>& outs, Tensors& ins,
                                        const c10d::GatherOptions& opts) override {
    return staged(outs, ins, "gather", [&](auto& o, auto& i) { return gloo_->gather(o, i, opts); });
  }
  c10::intrusive_ptr<c10d::Work> scatter(Tensors& outs, std::vector<Tensors>& ins,
                                         const c10d::ScatterOptions& opts) override {
    return staged(outs, ins, "scatter", [&](auto& o, auto& i) { return gloo_->scatter(o, i, opts); });
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(Tensors& outs, std::vector<Tensors>& ins,
                                                const c10d::ReduceScatterOptions& opts) override {
    return staged(
        outs, ins, "reduce_scatter", [&](auto& o, auto& i) { return gloo_->reduce_scatter(o, i, summing(opts)); },
        [&](auto& o) { average(opts, o, getSize()); });
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& opts) override {
    return staged(
        out, in, "reduce_scatter_tensor",
        [&](auto& o, auto& i) { return gloo_->_reduce_scatter_base(o, i, summing(opts)); },
        [&](auto& o) { average(opts, {o}, getSize()); });
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(Tensors& outs, Tensors& ins,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    for (size_t i = 0; i < outs.size(); ++i) _reduce_scatter_base(outs[i], ins[i], opts);
    return done(outs);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& opts) override {
    return staged(out, in, "all_to_all_single",
                  [&](auto& o, auto& i) { return gloo_->alltoall_base(o, i, out_splits, in_splits, opts); });
  }
  c10::intrusive_ptr<c10d::Work> alltoall(Tensors& outs, Tensors& ins, const c10d::AllToAllOptions& opts) override {
    return staged(outs, ins, "all_to_all", [&](auto& o, auto& i) { return gloo_->alltoall(o, i, opts); });
  }
  // Point to point returns pending work, as NCCL's does: a pipeline posts its receives before
  // its sends, and synchronous ones would deadlock it.
  c10::intrusive_ptr<c10d::Work> send(Tensors& ts, int dst, int tag) override {
    auto host = to_host(ts, "send");
    auto inner = gloo_->send(host, dst, tag);
    return c10::make_intrusive<PendingWork>(inner, [host] {});  // keeps the host copy alive
  }
  c10::intrusive_ptr<c10d::Work> recv(Tensors& ts, int src, int tag) override {
    auto host = to_host(ts, "recv");
    auto inner = gloo_->recv(host, src, tag);
    Tensors device = ts;
    return c10::make_intrusive<PendingWork>(inner, [device, host] { back(device, host); });
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    gloo_->barrier(opts)->wait();
    return done(Tensors{});
  }

 private:
  template <typename Buffers>
  static c10::intrusive_ptr<c10d::Work> done(const Buffers& outputs) {
    return c10::make_intrusive<DoneWork>(flat(outputs));
  }
  // Runs `run(host outputs, host inputs)` on host copies, then `finish(host outputs)` once it is
  // done (not inside `run`: a second wait on some gloo work copies its result out again), and
  // copies the outputs back. In-place collectives pass their tensors as both.
  template <typename Out, typename In, typename Run, typename Finish = void (*)(Out&)>
  static c10::intrusive_ptr<c10d::Work> staged(Out& outs, In& ins, const char* op, Run run,
                                               Finish finish = [](Out&) {}) {
    auto host_outs = to_host(outs, op);
    auto host_ins = [&] {
      if constexpr (std::is_same_v<Out, In>)
        if (&outs == &ins) return host_outs;  // in place: one copy, shared
      return to_host(ins, op);
    }();
    run(host_outs, host_ins)->wait();
    finish(host_outs);
    back(outs, host_outs);
    return done(outs);
  }
  c10::intrusive_ptr<c10d::Backend> gloo_;
};

// ---------------------------------------------------------------- Python

std::tuple<int64_t, int64_t> memory(DeviceIndex device) {
  check_index(device);
  std::lock_guard<std::mutex> lock(g_mutex);
  return {g_counters[device].allocated, g_counters[device].peak};
}

void reset_peak(DeviceIndex device) { g_memory.resetPeakStats(device); }

}  // namespace testdev

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace testdev;
  static bool hooks_registered = false;
  if (!hooks_registered) {
    at::RegisterPrivateUse1HooksInterface(new Hooks());
    hooks_registered = true;
  }
  m.def("set_device_count", [](int n) {
    TORCH_CHECK(n >= 1 && n <= kMaxDevices, "testdev: 1 to ", int(kMaxDevices), " devices, not ", n);
    g_device_count = static_cast<DeviceIndex>(n);
  });
  m.def("set_guard", [](bool on) { g_guard = on; }, "false: device memory stays host-readable (set before allocating)");
  m.def("device_count", [] { return int(g_device_count); });
  m.def("current_device", [] { return int(t_current); });
  m.def("set_device", [](int d) {
    check_index(static_cast<DeviceIndex>(d));
    t_current = static_cast<DeviceIndex>(d);
  });
  m.def("memory", &memory, "(allocated, peak) bytes of a device");
  m.def("reset_peak", &reset_peak);
  m.def("default_generator", [](int d) { return default_generator(static_cast<DeviceIndex>(d)); });
  m.def("staging_backend", [](c10::intrusive_ptr<c10d::Backend> gloo, int rank, int size) {
    return c10::intrusive_ptr<c10d::Backend>(c10::make_intrusive<StagingBackend>(std::move(gloo), rank, size));
  });
}
