#include "bench/nvml.h"

#include <dlfcn.h>

namespace trainscale::bench {
namespace {

// The few NVML types and constants used here (nvml.h values).
using nvmlReturn_t = int;
using nvmlDevice_t = void*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr int kClockSm = 1, kClockMem = 2;
constexpr int kTemperatureGpu = 0;
constexpr int kPerfPolicyPower = 0, kPerfPolicyThermal = 1;
struct nvmlViolationTime_t {
  unsigned long long reference_time;  // CPU timestamp, microseconds
  unsigned long long violation_time;  // nanoseconds
};

constexpr unsigned long long kSwPowerCap = 0x4, kHwSlowdown = 0x8, kSwThermal = 0x20, kHwThermal = 0x40,
                             kHwPowerBrake = 0x80;

}  // namespace

struct Nvml::Api {
  void* library = nullptr;
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*handle_by_index)(unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*handle_by_pci_bus_id)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*clock_info)(nvmlDevice_t, int, unsigned*) = nullptr;
  nvmlReturn_t (*max_clock_info)(nvmlDevice_t, int, unsigned*) = nullptr;
  nvmlReturn_t (*clock_event_reasons)(nvmlDevice_t, unsigned long long*) = nullptr;
  nvmlReturn_t (*violation_status)(nvmlDevice_t, int, nvmlViolationTime_t*) = nullptr;
  nvmlReturn_t (*temperature)(nvmlDevice_t, int, unsigned*) = nullptr;
  nvmlReturn_t (*power_usage)(nvmlDevice_t, unsigned*) = nullptr;
  nvmlReturn_t (*driver_version)(char*, unsigned) = nullptr;
  nvmlReturn_t (*name)(nvmlDevice_t, char*, unsigned) = nullptr;

  template <class Fn>
  void load(Fn& fn, const char* symbol) {
    fn = reinterpret_cast<Fn>(dlsym(library, symbol));
  }
};

Nvml* Nvml::get() {
  static const std::unique_ptr<Nvml> instance = []() -> std::unique_ptr<Nvml> {
    auto api = std::make_unique<Api>();
    api->library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!api->library) return nullptr;
    api->load(api->init, "nvmlInit_v2");
    api->load(api->handle_by_index, "nvmlDeviceGetHandleByIndex_v2");
    api->load(api->handle_by_pci_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
    api->load(api->clock_info, "nvmlDeviceGetClockInfo");
    api->load(api->max_clock_info, "nvmlDeviceGetMaxClockInfo");
    // Renamed in recent drivers; the old name remains as an alias on older ones.
    api->load(api->clock_event_reasons, "nvmlDeviceGetCurrentClocksEventReasons");
    if (!api->clock_event_reasons) api->load(api->clock_event_reasons, "nvmlDeviceGetCurrentClocksThrottleReasons");
    api->load(api->violation_status, "nvmlDeviceGetViolationStatus");
    api->load(api->temperature, "nvmlDeviceGetTemperature");
    api->load(api->power_usage, "nvmlDeviceGetPowerUsage");
    api->load(api->driver_version, "nvmlSystemGetDriverVersion");
    api->load(api->name, "nvmlDeviceGetName");
    if (!api->init || api->init() != kNvmlSuccess) {
      dlclose(api->library);
      return nullptr;
    }
    return std::unique_ptr<Nvml>(new Nvml(std::move(api)));
  }();
  return instance.get();
}

Nvml::Nvml(std::unique_ptr<Api> api) : api_(std::move(api)) {}
Nvml::~Nvml() = default;  // NVML stays initialized until exit; nvmlShutdown is not needed

std::optional<Nvml::Device> Nvml::device(const std::string& pci_bus_id, int index) const {
  nvmlDevice_t d = nullptr;
  if (api_->handle_by_pci_bus_id && !pci_bus_id.empty() &&
      api_->handle_by_pci_bus_id(pci_bus_id.c_str(), &d) == kNvmlSuccess) {
    return d;
  }
  if (api_->handle_by_index && api_->handle_by_index(static_cast<unsigned>(index), &d) == kNvmlSuccess) return d;
  return std::nullopt;
}

namespace {
template <class Fn, class... Args>
std::optional<unsigned> query_unsigned(Fn fn, Args... args) {
  unsigned v = 0;
  if (!fn || fn(args..., &v) != kNvmlSuccess) return std::nullopt;
  return v;
}
}  // namespace

std::optional<unsigned> Nvml::sm_clock_mhz(Device d) const { return query_unsigned(api_->clock_info, d, kClockSm); }
std::optional<unsigned> Nvml::max_sm_clock_mhz(Device d) const {
  return query_unsigned(api_->max_clock_info, d, kClockSm);
}
std::optional<unsigned> Nvml::mem_clock_mhz(Device d) const { return query_unsigned(api_->clock_info, d, kClockMem); }

std::optional<unsigned long long> Nvml::clock_event_reasons(Device d) const {
  unsigned long long reasons = 0;
  if (!api_->clock_event_reasons || api_->clock_event_reasons(d, &reasons) != kNvmlSuccess) return std::nullopt;
  return reasons;
}

namespace {
std::optional<unsigned long long> violation_ns(const Nvml::Api& api, nvmlDevice_t d, int policy) {
  nvmlViolationTime_t v{};
  if (!api.violation_status || api.violation_status(d, policy, &v) != kNvmlSuccess) return std::nullopt;
  return v.violation_time;
}
}  // namespace

std::optional<unsigned long long> Nvml::power_violation_ns(Device d) const {
  return violation_ns(*api_, d, kPerfPolicyPower);
}
std::optional<unsigned long long> Nvml::thermal_violation_ns(Device d) const {
  return violation_ns(*api_, d, kPerfPolicyThermal);
}

std::optional<double> Nvml::temperature_c(Device d) const {
  const auto t = query_unsigned(api_->temperature, d, kTemperatureGpu);
  return t ? std::optional<double>(*t) : std::nullopt;
}

std::optional<double> Nvml::power_w(Device d) const {
  const auto mw = query_unsigned(api_->power_usage, d);
  return mw ? std::optional<double>(*mw / 1000.0) : std::nullopt;
}

std::optional<std::string> Nvml::name(Device d) const {
  char buf[128] = {};
  if (!api_->name || api_->name(d, buf, sizeof buf) != kNvmlSuccess) return std::nullopt;
  return std::string(buf);
}

std::optional<std::string> Nvml::driver_version() const {
  char buf[96] = {};
  if (!api_->driver_version || api_->driver_version(buf, sizeof buf) != kNvmlSuccess) return std::nullopt;
  return std::string(buf);
}

bool is_throttling(unsigned long long reasons) {
  return (reasons & (kSwPowerCap | kHwSlowdown | kSwThermal | kHwThermal | kHwPowerBrake)) != 0;
}

std::string throttle_reason_names(unsigned long long reasons) {
  constexpr std::pair<unsigned long long, const char*> kNames[] = {
      {kSwPowerCap, "sw-power-cap"}, {kHwSlowdown, "hw-slowdown"}, {kSwThermal, "sw-thermal"},
      {kHwThermal, "hw-thermal"},    {kHwPowerBrake, "hw-power-brake"}};
  std::string names;
  for (const auto& [bit, name] : kNames) {
    if (!(reasons & bit)) continue;
    if (!names.empty()) names += ',';
    names += name;
  }
  return names;
}

namespace {

class NvmlClockMonitor : public ClockMonitor {
 public:
  NvmlClockMonitor(Nvml& nvml, Nvml::Device device) : nvml_(nvml), device_(device) {}
  void start() override {
    power_ns_ = nvml_.power_violation_ns(device_);
    thermal_ns_ = nvml_.thermal_violation_ns(device_);
  }
  std::optional<ClockObservation> observe() override {
    ClockObservation o;
    o.sm_mhz = nvml_.sm_clock_mhz(device_).value_or(0);
    const unsigned long long reasons = nvml_.clock_event_reasons(device_).value_or(0);
    o.throttled = is_throttling(reasons);
    o.reasons = throttle_reason_names(reasons);
    note_violation(o, power_ns_, nvml_.power_violation_ns(device_), "power-violation");
    note_violation(o, thermal_ns_, nvml_.thermal_violation_ns(device_), "thermal-violation");
    return o;
  }

 private:
  // A violation time that rose since the last read marks the sample throttled.
  static void note_violation(ClockObservation& o, std::optional<unsigned long long>& last,
                             std::optional<unsigned long long> now, const char* name) {
    if (last && now && *now > *last) {
      o.throttled = true;
      o.reasons += o.reasons.empty() ? name : std::string(",") + name;
    }
    last = now;
  }

  Nvml& nvml_;
  Nvml::Device device_;
  std::optional<unsigned long long> power_ns_, thermal_ns_;
};

}  // namespace

std::unique_ptr<ClockMonitor> make_nvml_clock_monitor(Nvml& nvml, Nvml::Device device) {
  return std::make_unique<NvmlClockMonitor>(nvml, device);
}

}  // namespace trainscale::bench
