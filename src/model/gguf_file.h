// GgufFile: a read-only, memory-mapped GGUF (v2 or v3) model file, fully
// validated before anything is used.
//
// GGUF layout (little-endian):
//   u32 magic "GGUF" | u32 version | u64 tensor_count | u64 metadata_count
//   metadata_count x (string key, u32 value_type, value)
//   tensor_count   x (string name, u32 n_dims, n_dims x u64 dim, u32 ggml_type, u64 offset)
//   padding to general.alignment (default 32)
//   tensor data; each tensor at data_start + offset
// where string = u64 length + bytes, and an array value = u32 element type,
// u64 count, elements.
//
// Every offset, size, count, string length and tensor type is bounds-checked
// against the file before use: a truncated, corrupted or hostile file gives a
// Status naming what is wrong (and where), never a crash and never an
// allocation larger than the file itself.
//
// Thread safety: immutable after Open; safe to share. Ownership: owns the
// mapping; tensor data pointers stay valid for the object's lifetime.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kernels/weight_formats.h"
#include "pagekv/status.h"

namespace pagekv {

// GGUF metadata value types (the file's u32 codes).
enum class GgufType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

// ggml tensor types this loader understands (others are named in the error).
enum class GgmlType : uint32_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
};

std::string_view GgmlTypeName(uint32_t type);

// The storage format of a tensor type this loader understands; nullopt for
// any other id (IQ*, TQ*, q8_1, integers, unknown).
std::optional<WeightType> WeightTypeOf(uint32_t ggml_type);

// One metadata value. Integers widen to int64/uint64, floats to double.
struct GgufValue {
  GgufType type = GgufType::kU8;
  std::variant<int64_t, uint64_t, double, bool, std::string> scalar;
  // Arrays: element type and elements (scalars widened as above).
  GgufType element_type = GgufType::kU8;
  std::vector<std::variant<int64_t, uint64_t, double, bool, std::string>> elements;
  bool is_array() const { return type == GgufType::kArray; }
};

struct GgufTensor {
  std::string name;
  GgmlType type = GgmlType::kF32;
  std::vector<int64_t> dims;  // ggml order: dims[0] is the contiguous (fastest) one
  int64_t num_elements = 0;
  int64_t num_bytes = 0;
  const std::byte* data = nullptr;  // inside the mapping
};

class GgufFile {
 public:
  // Maps and validates `path`. Errors: NotFound / IoError for the file,
  // DataLoss for anything malformed (with the byte offset), Unimplemented for
  // a valid but unsupported version or tensor type (named).
  static Result<std::unique_ptr<GgufFile>> Open(const std::string& path);

  // Validates an in-memory image (copied). Same errors as Open.
  static Result<std::unique_ptr<GgufFile>> FromBytes(std::string_view bytes);

  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const { return version_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }

  const GgufValue* Find(std::string_view key) const;
  const GgufTensor* FindTensor(std::string_view name) const;

  // True when the tensors live in a read-only private mapping of the file
  // (Open), false for an in-memory image (FromBytes).
  bool mapped() const { return mapped_; }

  // Typed getters: NotFound when missing, DataLoss when the type does not fit.
  Result<int64_t> GetInt(std::string_view key) const;
  Result<double> GetFloat(std::string_view key) const;
  Result<std::string> GetString(std::string_view key) const;
  Result<bool> GetBool(std::string_view key) const;

 private:
  GgufFile() = default;
  Status Parse();

  const std::byte* base_ = nullptr;  // [size_]
  size_t size_ = 0;
  bool mapped_ = false;              // munmap on destruction, else owned_ holds the bytes
  std::vector<std::byte> owned_;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensor> tensors_;
};

// Builds GGUF images: the synthetic-checkpoint writer and the tests use it.
class GgufWriter {
 public:
  void AddInt(const std::string& key, GgufType type, int64_t value);  // kU8..kI64, kBool
  void AddFloat(const std::string& key, double value);                // kF32
  void AddString(const std::string& key, const std::string& value);
  void AddStringArray(const std::string& key, const std::vector<std::string>& values);
  void AddFloatArray(const std::string& key, const std::vector<float>& values);
  void AddIntArray(const std::string& key, const std::vector<int32_t>& values);
  // A value read from another file (GgufFile::metadata), copied with its
  // type: any scalar, and arrays of strings, f32 or i32. Errors: another
  // array element type (nothing added).
  Status AddValue(const std::string& key, const GgufValue& value);
  // dims in ggml order; data must hold the tensor's bytes.
  void AddTensor(const std::string& name, GgmlType type, const std::vector<int64_t>& dims,
                 const void* data, size_t bytes);
  // The whole file, data aligned to 32 bytes.
  std::string Finish(uint32_t version = 3) const;
  // The same bytes streamed to `path`: written to a temporary file beside it
  // and renamed into place, so a failure leaves no partial file behind.
  Status WriteFile(const std::string& path, uint32_t version = 3) const;

 private:
  std::string meta_;
  uint64_t meta_count_ = 0;
  struct Pending {
    std::string name;
    GgmlType type;
    std::vector<int64_t> dims;
    std::string bytes;
  };
  std::vector<Pending> tensors_;

  std::string Header(uint32_t version) const;  // up to the aligned start of the data
};

// ggml q8_0: per 32 values, an f16 scale (max |x| / 127) then 32 int8.
// REQUIRES: n % 32 == 0; out holds n / 32 * 34 bytes.
void EncodeQ8_0(const float* x, int64_t n, std::byte* out);

}  // namespace pagekv
