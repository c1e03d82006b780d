#include "pagekv/dtype.h"

#include <cctype>
#include <string>

namespace pagekv {

int DTypeBits(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 32;
    case DType::kF16:
    case DType::kBF16: return 16;
    case DType::kFP8E4M3:
    case DType::kFP8E5M2:
    case DType::kInt8: return 8;
    case DType::kInt4: return 4;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kFP8E4M3: return "fp8_e4m3";
    case DType::kFP8E5M2: return "fp8_e5m2";
    case DType::kInt8: return "int8";
    case DType::kInt4: return "int4";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view name) {
  std::string n(name);
  for (char& c : n) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (n == "f32" || n == "fp32" || n == "float32" || n == "float") return DType::kF32;
  if (n == "f16" || n == "fp16" || n == "float16" || n == "half") return DType::kF16;
  if (n == "bf16" || n == "bfloat16") return DType::kBF16;
  if (n == "fp8_e4m3" || n == "fp8-e4m3" || n == "e4m3" || n == "fp8") return DType::kFP8E4M3;
  if (n == "fp8_e5m2" || n == "fp8-e5m2" || n == "e5m2") return DType::kFP8E5M2;
  if (n == "int8" || n == "i8" || n == "q8") return DType::kInt8;
  if (n == "int4" || n == "i4" || n == "q4") return DType::kInt4;
  return InvalidArgumentError("unknown dtype '" + std::string(name) +
                              "': use one of f32, f16, bf16, fp8_e4m3, fp8_e5m2, int8, int4");
}

KvFormat KvFormat::ForDType(DType d, int32_t row_elems) {
  switch (d) {
    case DType::kInt8: return Int8(row_elems);
    case DType::kFP8E4M3:
    case DType::kFP8E5M2: return Fp8(d, row_elems);
    case DType::kInt4: return Int4Kivi(kDefaultKiviGroup);
    default: return Plain(d);
  }
}

bool KvFormat::IsStoredQuantized(int32_t row_elems) const {
  return (dtype == DType::kInt8 || dtype == DType::kFP8E4M3 || dtype == DType::kFP8E5M2) && scale_axis == ScaleAxis::kPerToken && group_size == row_elems &&
         scale_dtype == DType::kF16;
}

bool KvFormat::IsPlainFloat() const {
  return scale_axis == ScaleAxis::kNone &&
         (dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16);
}

std::string KvFormat::ToString() const {
  std::string out(DTypeName(dtype));
  if (scale_axis == ScaleAxis::kNone) return out;
  if (hadamard) out += ", Hadamard-rotated";
  out += " (";
  out += DTypeName(scale_dtype);
  out += " scale per ";
  out += std::to_string(group_size);
  out += scale_axis == ScaleAxis::kPerToken ? " elements of a token)" : " tokens of a channel";
  if (IsKivi()) out += " for keys, per token for values; KIVI";
  if (scale_axis != ScaleAxis::kPerToken) out += ")";
  return out;
}

}  // namespace pagekv
