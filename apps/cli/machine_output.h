// The machine a benchmark figure came from: the line at the top of every
// bench's text output and the "machine" object of its JSON.
#pragma once

#include <nlohmann/json.hpp>

namespace pagekv::cli {

nlohmann::ordered_json MachineJson();
void PrintMachine();

}  // namespace pagekv::cli
