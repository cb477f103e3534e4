// NVML loaded at run time (dlopen "libnvidia-ml.so.1"), so the build needs neither nvml.h nor
// the library; every query returns nothing when NVML or the entry point is missing.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "bench/timing.h"

namespace trainscale::bench {

class Nvml {
 public:
  // The process-wide instance, or nullptr when NVML cannot be loaded or initialized.
  static Nvml* get();

  // The NVML handle of a CUDA device, matched by PCI bus id ("0000:3B:00.0"), else by index.
  using Device = void*;
  std::optional<Device> device(const std::string& pci_bus_id, int index) const;

  std::optional<unsigned> sm_clock_mhz(Device d) const;
  std::optional<unsigned> max_sm_clock_mhz(Device d) const;
  std::optional<unsigned> mem_clock_mhz(Device d) const;
  std::optional<unsigned long long> clock_event_reasons(Device d) const;
  // Nanoseconds the device has spent held under its power (or thermal) limit, cumulative
  // (nvmlDeviceGetViolationStatus): a rise between two reads means a slowdown happened between
  // them, even one over by the time the clock event reasons are read.
  std::optional<unsigned long long> power_violation_ns(Device d) const;
  std::optional<unsigned long long> thermal_violation_ns(Device d) const;
  std::optional<double> temperature_c(Device d) const;
  std::optional<double> power_w(Device d) const;
  std::optional<std::string> name(Device d) const;
  std::optional<std::string> driver_version() const;

  struct Api;
  ~Nvml();

 private:
  explicit Nvml(std::unique_ptr<Api> api);
  std::unique_ptr<Api> api_;
};

// Thermal and power slowdown bits of NVML's clock event (throttle) reasons.
bool is_throttling(unsigned long long reasons);
std::string throttle_reason_names(unsigned long long reasons);  // "sw-power-cap,hw-thermal"

// Clock monitor backed by NVML: after each sample the SM clock, the throttle reasons, and whether
// the power or thermal violation time rose since the previous sample (or the row's start).
std::unique_ptr<ClockMonitor> make_nvml_clock_monitor(Nvml& nvml, Nvml::Device device);

}  // namespace trainscale::bench
