// The JSON form of a run (docs/bench-json.md): write, read back, validate.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "bench/result.h"

namespace trainscale::bench {

nlohmann::json to_json(const RunResult& result);
nlohmann::json to_json(const Roofline& roofline);
nlohmann::json to_json(const Environment& env);
// Throws trainscale::Error when the document is not a trainscale-bench result of a schema
// version this build understands.
RunResult run_result_from_json(const nlohmann::json& j);
Roofline roofline_from_json(const nlohmann::json& j);

void write_json_file(const std::string& path, const nlohmann::json& j);
nlohmann::json read_json_file(const std::string& path);  // throws trainscale::Error

}  // namespace trainscale::bench
