#include "model/gguf_file.h"

#include "base/regular_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "base/checked_math.h"
#include "layout/float16.h"

namespace pagekv {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr int kMaxDims = 4;
constexpr uint64_t kDefaultAlignment = 32;

std::string At(size_t pos) { return " at byte " + std::to_string(pos); }

// Bounded little-endian reader over the file image.
class Reader {
 public:
  Reader(const std::byte* data, size_t size) : data_(data), size_(size) {}
  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  Status Need(uint64_t bytes, std::string_view what) const {
    if (bytes > remaining()) {
      return DataLossError("truncated file: " + std::string(what) + At(pos_) + " needs " +
                           std::to_string(bytes) + " bytes, only " + std::to_string(remaining()) + " remain");
    }
    return Status::Ok();
  }
  template <typename T>
  Status Read(T* out, std::string_view what) {
    PAGEKV_RETURN_IF_ERROR(Need(sizeof(T), what));
    std::memcpy(out, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::Ok();
  }
  Status ReadString(std::string* out, std::string_view what) {
    uint64_t len = 0;
    PAGEKV_RETURN_IF_ERROR(Read(&len, what));
    if (len > remaining()) {
      return DataLossError("corrupt file: " + std::string(what) + " has length " + std::to_string(len) + At(pos_) +
                           ", beyond the end of the file");
    }
    out->assign(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return Status::Ok();
  }

 private:
  const std::byte* data_;
  size_t size_;
  size_t pos_ = 0;
};

using Scalar = std::variant<int64_t, uint64_t, double, bool, std::string>;

// Smallest encoding of one value of `type` (for bounding array counts).
uint64_t MinSize(GgufType type) {
  switch (type) {
    case GgufType::kU8: case GgufType::kI8: case GgufType::kBool: return 1;
    case GgufType::kU16: case GgufType::kI16: return 2;
    case GgufType::kU32: case GgufType::kI32: case GgufType::kF32: return 4;
    case GgufType::kU64: case GgufType::kI64: case GgufType::kF64: case GgufType::kString: return 8;
    case GgufType::kArray: return 12;
  }
  return 1;
}

bool KnownType(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::kF64); }

Status ReadScalar(Reader& r, GgufType type, const std::string& key, Scalar* out) {
  switch (type) {
#define PAGEKV_GGUF_INT(code, ctype, stored)                          \
  case GgufType::code: {                                              \
    ctype v{};                                                        \
    PAGEKV_RETURN_IF_ERROR(r.Read(&v, "value of '" + key + "'"));     \
    *out = static_cast<stored>(v);                                    \
    return Status::Ok();                                              \
  }
    PAGEKV_GGUF_INT(kU8, uint8_t, int64_t)
    PAGEKV_GGUF_INT(kI8, int8_t, int64_t)
    PAGEKV_GGUF_INT(kU16, uint16_t, int64_t)
    PAGEKV_GGUF_INT(kI16, int16_t, int64_t)
    PAGEKV_GGUF_INT(kU32, uint32_t, int64_t)
    PAGEKV_GGUF_INT(kI32, int32_t, int64_t)
    PAGEKV_GGUF_INT(kU64, uint64_t, uint64_t)
    PAGEKV_GGUF_INT(kI64, int64_t, int64_t)
    PAGEKV_GGUF_INT(kF32, float, double)
    PAGEKV_GGUF_INT(kF64, double, double)
#undef PAGEKV_GGUF_INT
    case GgufType::kBool: {
      uint8_t v = 0;
      PAGEKV_RETURN_IF_ERROR(r.Read(&v, "value of '" + key + "'"));
      if (v > 1) return DataLossError("corrupt file: bool '" + key + "' holds " + std::to_string(v) + At(r.pos()));
      *out = v == 1;
      return Status::Ok();
    }
    case GgufType::kString: {
      std::string s;
      PAGEKV_RETURN_IF_ERROR(r.ReadString(&s, "string value of '" + key + "'"));
      *out = std::move(s);
      return Status::Ok();
    }
    case GgufType::kArray: break;
  }
  return DataLossError("corrupt file: '" + key + "': nested arrays are not supported" + At(r.pos()));
}

// Bytes of a tensor of `type` with `elements` elements whose row is dims0.
Result<int64_t> TensorBytes(const std::string& name, uint32_t type, int64_t dims0, int64_t elements) {
  const std::optional<WeightType> w = WeightTypeOf(type);
  if (!w) {
    return UnimplementedError("tensor '" + name + "' has type " + std::string(GgmlTypeName(type)) + " (" +
                              std::to_string(type) + "): supported types are f32, f16, bf16, q4_0, q4_1, q5_0, "
                              "q5_1, q8_0, q2_K, q3_K, q4_K, q5_K and q6_K (requantize it, e.g. with llama-quantize)");
  }
  const WeightFormat& f = FormatOf(*w);
  if (dims0 % f.block_elems != 0) {
    return DataLossError("corrupt file: " + std::string(f.name) + " tensor '" + name + "' has a row of " +
                         std::to_string(dims0) + " elements, not a multiple of " + std::to_string(f.block_elems));
  }
  int64_t bytes = 0;
  if (__builtin_mul_overflow(elements / f.block_elems, static_cast<int64_t>(f.block_bytes), &bytes)) {
    return DataLossError("corrupt file: " + std::string(f.name) + " tensor '" + name + "' has " +
                         std::to_string(elements) + " elements, more bytes than any file can hold");
  }
  return bytes;
}

}  // namespace

std::optional<WeightType> WeightTypeOf(uint32_t ggml_type) {
  switch (static_cast<GgmlType>(ggml_type)) {
    case GgmlType::kF32: return WeightType::kF32;
    case GgmlType::kF16: return WeightType::kF16;
    case GgmlType::kBF16: return WeightType::kBF16;
    case GgmlType::kQ4_0: return WeightType::kQ4_0;
    case GgmlType::kQ4_1: return WeightType::kQ4_1;
    case GgmlType::kQ5_0: return WeightType::kQ5_0;
    case GgmlType::kQ5_1: return WeightType::kQ5_1;
    case GgmlType::kQ8_0: return WeightType::kQ8_0;
    case GgmlType::kQ2_K: return WeightType::kQ2_K;
    case GgmlType::kQ3_K: return WeightType::kQ3_K;
    case GgmlType::kQ4_K: return WeightType::kQ4_K;
    case GgmlType::kQ5_K: return WeightType::kQ5_K;
    case GgmlType::kQ6_K: return WeightType::kQ6_K;
  }
  return std::nullopt;
}

std::string_view GgmlTypeName(uint32_t type) {
  static constexpr const char* kNames[] = {
      "f32", "f16", "q4_0", "q4_1", "q4_2", "q4_3", "q5_0", "q5_1", "q8_0", "q8_1", "q2_K", "q3_K", "q4_K",
      "q5_K", "q6_K", "q8_K", "iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s", "iq4_nl", "iq3_s", "iq2_s", "iq4_xs",
      "i8", "i16", "i32", "i64", "f64", "iq1_m", "bf16"};
  return type < std::size(kNames) ? kNames[type] : "unknown";
}

Result<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  PAGEKV_ASSIGN_OR_RETURN(RegularFile rf, OpenRegularFile(path, "model file"));
  const int fd = rf.fd;
  auto file = std::unique_ptr<GgufFile>(new GgufFile());
  file->size_ = static_cast<size_t>(rf.size);
  if (file->size_ == 0) {
    ::close(fd);
    return DataLossError("model file '" + path + "' is empty");
  }
  void* p = mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return IoError("cannot map '" + path + "': " + std::strerror(errno));
  file->base_ = static_cast<const std::byte*>(p);
  file->mapped_ = true;
  Status s = file->Parse();
  if (!s.ok()) return Status(s.code(), "'" + path + "': " + s.message());
  return file;
}

Result<std::unique_ptr<GgufFile>> GgufFile::FromBytes(std::string_view bytes) {
  auto file = std::unique_ptr<GgufFile>(new GgufFile());
  file->owned_.resize(bytes.size());
  if (!bytes.empty()) std::memcpy(file->owned_.data(), bytes.data(), bytes.size());
  file->base_ = file->owned_.data();
  file->size_ = bytes.size();
  PAGEKV_RETURN_IF_ERROR(file->Parse());
  return file;
}

GgufFile::~GgufFile() {
  if (mapped_) munmap(const_cast<std::byte*>(base_), size_);
}

Status GgufFile::Parse() {
  Reader r(base_, size_);
  uint32_t magic = 0;
  PAGEKV_RETURN_IF_ERROR(r.Read(&magic, "magic number"));
  if (magic != kMagic) {
    return DataLossError("not a GGUF file: the first 4 bytes are not \"GGUF\"");
  }
  PAGEKV_RETURN_IF_ERROR(r.Read(&version_, "version"));
  if (version_ != 2 && version_ != 3) {
    return UnimplementedError("GGUF version " + std::to_string(version_) + " is not supported: use version 2 or 3");
  }
  uint64_t tensor_count = 0, meta_count = 0;
  PAGEKV_RETURN_IF_ERROR(r.Read(&tensor_count, "tensor count"));
  PAGEKV_RETURN_IF_ERROR(r.Read(&meta_count, "metadata count"));
  // Each metadata entry takes at least 8 + 4 + 1 bytes, each tensor info 8 + 4 + 8 + 4 + 8.
  if (meta_count > r.remaining() / 13) {
    return DataLossError("corrupt file: metadata count " + std::to_string(meta_count) + " cannot fit in " +
                         std::to_string(size_) + " bytes");
  }
  if (tensor_count > r.remaining() / 32) {
    return DataLossError("corrupt file: tensor count " + std::to_string(tensor_count) + " cannot fit in " +
                         std::to_string(size_) + " bytes");
  }

  for (uint64_t i = 0; i < meta_count; ++i) {
    std::string key;
    PAGEKV_RETURN_IF_ERROR(r.ReadString(&key, "metadata key " + std::to_string(i)));
    uint32_t type = 0;
    PAGEKV_RETURN_IF_ERROR(r.Read(&type, "type of '" + key + "'"));
    if (!KnownType(type)) {
      return DataLossError("corrupt file: metadata '" + key + "' has unknown value type " + std::to_string(type) + At(r.pos()));
    }
    GgufValue value;
    value.type = static_cast<GgufType>(type);
    if (value.type == GgufType::kArray) {
      uint32_t elem = 0;
      uint64_t count = 0;
      PAGEKV_RETURN_IF_ERROR(r.Read(&elem, "element type of '" + key + "'"));
      PAGEKV_RETURN_IF_ERROR(r.Read(&count, "element count of '" + key + "'"));
      if (!KnownType(elem) || static_cast<GgufType>(elem) == GgufType::kArray) {
        return DataLossError("corrupt file: array '" + key + "' has unsupported element type " + std::to_string(elem));
      }
      value.element_type = static_cast<GgufType>(elem);
      if (count > r.remaining() / MinSize(value.element_type)) {
        return DataLossError("corrupt file: array '" + key + "' claims " + std::to_string(count) +
                             " elements, more than the file can hold" + At(r.pos()));
      }
      value.elements.resize(static_cast<size_t>(count));
      for (uint64_t e = 0; e < count; ++e) {
        PAGEKV_RETURN_IF_ERROR(ReadScalar(r, value.element_type, key, &value.elements[static_cast<size_t>(e)]));
      }
    } else {
      PAGEKV_RETURN_IF_ERROR(ReadScalar(r, value.type, key, &value.scalar));
    }
    if (!metadata_.emplace(key, std::move(value)).second) {
      return DataLossError("corrupt file: metadata key '" + key + "' appears twice");
    }
  }

  uint64_t alignment = kDefaultAlignment;
  if (const GgufValue* a = Find("general.alignment")) {
    const auto* v = std::get_if<int64_t>(&a->scalar);
    if (v == nullptr || *v <= 0 || !IsPowerOfTwo(*v)) {
      return DataLossError("corrupt file: general.alignment must be a power of two");
    }
    alignment = static_cast<uint64_t>(*v);
  }

  struct Info {
    uint32_t type;
    uint64_t offset;
  };
  std::vector<Info> infos;
  tensors_.resize(static_cast<size_t>(tensor_count));
  infos.resize(static_cast<size_t>(tensor_count));
  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensor& t = tensors_[static_cast<size_t>(i)];
    PAGEKV_RETURN_IF_ERROR(r.ReadString(&t.name, "tensor name " + std::to_string(i)));
    uint32_t n_dims = 0;
    PAGEKV_RETURN_IF_ERROR(r.Read(&n_dims, "dimension count of '" + t.name + "'"));
    if (n_dims == 0 || n_dims > kMaxDims) {
      return DataLossError("corrupt file: tensor '" + t.name + "' has " + std::to_string(n_dims) +
                           " dimensions (1 to 4 allowed)");
    }
    int64_t elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t dim = 0;
      PAGEKV_RETURN_IF_ERROR(r.Read(&dim, "dimension of '" + t.name + "'"));
      if (dim == 0 || dim > (uint64_t{1} << 40) || __builtin_mul_overflow(elements, static_cast<int64_t>(dim), &elements)) {
        return DataLossError("corrupt file: tensor '" + t.name + "' has an impossible dimension " + std::to_string(dim));
      }
      t.dims.push_back(static_cast<int64_t>(dim));
    }
    t.num_elements = elements;
    Info& info = infos[static_cast<size_t>(i)];
    PAGEKV_RETURN_IF_ERROR(r.Read(&info.type, "type of '" + t.name + "'"));
    PAGEKV_RETURN_IF_ERROR(r.Read(&info.offset, "offset of '" + t.name + "'"));
    PAGEKV_ASSIGN_OR_RETURN(t.num_bytes, TensorBytes(t.name, info.type, t.dims[0], elements));
    t.type = static_cast<GgmlType>(info.type);
  }

  const uint64_t data_start = RoundUp(static_cast<int64_t>(r.pos()), static_cast<int64_t>(alignment));
  for (size_t i = 0; i < tensors_.size(); ++i) {
    GgufTensor& t = tensors_[i];
    const uint64_t off = infos[i].offset;
    if (off % alignment != 0) {
      return DataLossError("corrupt file: tensor '" + t.name + "' offset " + std::to_string(off) +
                           " is not aligned to " + std::to_string(alignment));
    }
    if (off > size_ || data_start > size_ - off || static_cast<uint64_t>(t.num_bytes) > size_ - data_start - off) {
      return DataLossError("truncated or corrupt file: tensor '" + t.name + "' (" + std::to_string(t.num_bytes) +
                           " bytes at data offset " + std::to_string(off) + ") runs past the end of the " +
                           std::to_string(size_) + "-byte file");
    }
    t.data = base_ + data_start + off;
    for (size_t j = 0; j < i; ++j) {
      if (tensors_[j].name == t.name) return DataLossError("corrupt file: tensor '" + t.name + "' appears twice");
    }
  }
  return Status::Ok();
}

const GgufValue* GgufFile::Find(std::string_view key) const {
  auto it = metadata_.find(std::string(key));
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufTensor* GgufFile::FindTensor(std::string_view name) const {
  for (const GgufTensor& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

Result<int64_t> GgufFile::GetInt(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return NotFoundError("model metadata '" + std::string(key) + "' is missing");
  if (const auto* i = std::get_if<int64_t>(&v->scalar); i != nullptr && !v->is_array()) return *i;
  if (const auto* u = std::get_if<uint64_t>(&v->scalar); u != nullptr && !v->is_array() && *u <= INT64_MAX) {
    return static_cast<int64_t>(*u);
  }
  return DataLossError("model metadata '" + std::string(key) + "' is not an integer");
}

Result<double> GgufFile::GetFloat(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return NotFoundError("model metadata '" + std::string(key) + "' is missing");
  if (const auto* d = std::get_if<double>(&v->scalar); d != nullptr && !v->is_array()) return *d;
  return DataLossError("model metadata '" + std::string(key) + "' is not a float");
}

Result<bool> GgufFile::GetBool(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return NotFoundError("model metadata '" + std::string(key) + "' is missing");
  if (const auto* b = std::get_if<bool>(&v->scalar); b != nullptr && !v->is_array()) return *b;
  return DataLossError("model metadata '" + std::string(key) + "' is not a bool");
}

Result<std::string> GgufFile::GetString(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return NotFoundError("model metadata '" + std::string(key) + "' is missing");
  if (const auto* s = std::get_if<std::string>(&v->scalar); s != nullptr && !v->is_array()) return *s;
  return DataLossError("model metadata '" + std::string(key) + "' is not a string");
}

// ---------------------------------------------------------------- writer

namespace {

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
void PutString(std::string& out, const std::string& s) {
  Put<uint64_t>(out, s.size());
  out += s;
}

}  // namespace

void GgufWriter::AddInt(const std::string& key, GgufType type, int64_t value) {
  PutString(meta_, key);
  Put<uint32_t>(meta_, static_cast<uint32_t>(type));
  switch (type) {
    case GgufType::kU8: case GgufType::kI8: case GgufType::kBool: Put<uint8_t>(meta_, static_cast<uint8_t>(value)); break;
    case GgufType::kU16: case GgufType::kI16: Put<uint16_t>(meta_, static_cast<uint16_t>(value)); break;
    case GgufType::kU32: case GgufType::kI32: Put<uint32_t>(meta_, static_cast<uint32_t>(value)); break;
    default: Put<uint64_t>(meta_, static_cast<uint64_t>(value)); break;
  }
  ++meta_count_;
}

void GgufWriter::AddFloat(const std::string& key, double value) {
  PutString(meta_, key);
  Put<uint32_t>(meta_, static_cast<uint32_t>(GgufType::kF32));
  Put<float>(meta_, static_cast<float>(value));
  ++meta_count_;
}

void GgufWriter::AddString(const std::string& key, const std::string& value) {
  PutString(meta_, key);
  Put<uint32_t>(meta_, static_cast<uint32_t>(GgufType::kString));
  PutString(meta_, value);
  ++meta_count_;
}

void GgufWriter::AddStringArray(const std::string& key, const std::vector<std::string>& values) {
  PutString(meta_, key);
  Put<uint32_t>(meta_, static_cast<uint32_t>(GgufType::kArray));
  Put<uint32_t>(meta_, static_cast<uint32_t>(GgufType::kString));
  Put<uint64_t>(meta_, values.size());
  for (const std::string& v : values) PutString(meta_, v);
  ++meta_count_;
}

void GgufWriter::AddFloatArray(const std::string& key, const std::vector<float>& values) {
  PutString(meta_, key);
  Put<uint32_t>(meta_, static_cast<uint32_t>(GgufType::kArray));
  Put<uint32_t>(meta_, static_cast<uint32_t>(GgufType::kF32));
  Put<uint64_t>(meta_, values.size());
  for (float v : values) Put<float>(meta_, v);
  ++meta_count_;
}

void GgufWriter::AddIntArray(const std::string& key, const std::vector<int32_t>& values) {
  PutString(meta_, key);
  Put<uint32_t>(meta_, static_cast<uint32_t>(GgufType::kArray));
  Put<uint32_t>(meta_, static_cast<uint32_t>(GgufType::kI32));
  Put<uint64_t>(meta_, values.size());
  for (int32_t v : values) Put<int32_t>(meta_, v);
  ++meta_count_;
}

Status GgufWriter::AddValue(const std::string& key, const GgufValue& v) {
  if (v.is_array()) {
    if (v.element_type == GgufType::kString) {
      std::vector<std::string> xs;
      for (const auto& e : v.elements) xs.push_back(std::get<std::string>(e));
      AddStringArray(key, xs);
    } else if (v.element_type == GgufType::kF32) {
      std::vector<float> xs;
      for (const auto& e : v.elements) xs.push_back(static_cast<float>(std::get<double>(e)));
      AddFloatArray(key, xs);
    } else if (v.element_type == GgufType::kI32) {
      std::vector<int32_t> xs;
      for (const auto& e : v.elements) xs.push_back(static_cast<int32_t>(std::get<int64_t>(e)));
      AddIntArray(key, xs);
    } else {
      return UnimplementedError("gguf writer: '" + key + "' is an array of a type the writer does not write");
    }
  } else if (const auto* str = std::get_if<std::string>(&v.scalar)) {
    AddString(key, *str);
  } else if (const auto* d = std::get_if<double>(&v.scalar)) {
    AddFloat(key, *d);
  } else if (const auto* i = std::get_if<int64_t>(&v.scalar)) {
    AddInt(key, v.type, *i);
  } else if (const auto* u = std::get_if<uint64_t>(&v.scalar)) {
    AddInt(key, v.type, static_cast<int64_t>(*u));
  } else if (const auto* b = std::get_if<bool>(&v.scalar)) {
    AddInt(key, GgufType::kBool, *b ? 1 : 0);
  }
  return Status::Ok();
}

void GgufWriter::AddTensor(const std::string& name, GgmlType type, const std::vector<int64_t>& dims,
                           const void* data, size_t bytes) {
  tensors_.push_back({name, type, dims, std::string(static_cast<const char*>(data), bytes)});
}

std::string GgufWriter::Header(uint32_t version) const {
  std::string out;
  Put<uint32_t>(out, kMagic);
  Put<uint32_t>(out, version);
  Put<uint64_t>(out, tensors_.size());
  Put<uint64_t>(out, meta_count_);
  out += meta_;
  uint64_t offset = 0;
  for (const Pending& t : tensors_) {
    PutString(out, t.name);
    Put<uint32_t>(out, static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) Put<uint64_t>(out, static_cast<uint64_t>(d));
    Put<uint32_t>(out, static_cast<uint32_t>(t.type));
    Put<uint64_t>(out, offset);
    offset = static_cast<uint64_t>(RoundUp(static_cast<int64_t>(offset + t.bytes.size()), kDefaultAlignment));
  }
  out.resize(static_cast<size_t>(RoundUp(static_cast<int64_t>(out.size()), kDefaultAlignment)), '\0');
  return out;
}

std::string GgufWriter::Finish(uint32_t version) const {
  std::string out = Header(version);
  for (const Pending& t : tensors_) {
    out += t.bytes;
    out.resize(static_cast<size_t>(RoundUp(static_cast<int64_t>(out.size()), kDefaultAlignment)), '\0');
  }
  return out;
}

Status GgufWriter::WriteFile(const std::string& path, uint32_t version) const {
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return IoError("cannot create '" + tmp + "': " + std::strerror(errno));
  const std::string header = Header(version);
  bool ok = std::fwrite(header.data(), 1, header.size(), f) == header.size();
  const char zeros[kDefaultAlignment] = {};
  for (const Pending& t : tensors_) {
    if (!ok) break;
    const size_t pad = static_cast<size_t>(RoundUp(static_cast<int64_t>(t.bytes.size()), kDefaultAlignment)) - t.bytes.size();
    ok = std::fwrite(t.bytes.data(), 1, t.bytes.size(), f) == t.bytes.size() && std::fwrite(zeros, 1, pad, f) == pad;
  }
  ok = std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0 && ok;
  const int err = errno;
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(ok ? errno : err);
    std::remove(tmp.c_str());
    return IoError("cannot write '" + path + "': " + why);
  }
  return Status::Ok();
}

void EncodeQ8_0(const float* x, int64_t n, std::byte* out) {
  for (int64_t b = 0; b < n / 32; ++b) {
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    const uint16_t h = F32ToF16(amax / 127.0f);
    const float scale = F16ToF32(h);
    std::byte* block = out + b * 34;
    std::memcpy(block, &h, 2);
    for (int i = 0; i < 32; ++i) {
      const long q = scale == 0 ? 0 : std::lround(x[b * 32 + i] / scale);
      block[2 + i] = static_cast<std::byte>(static_cast<int8_t>(std::clamp<long>(q, -127, 127)));
    }
  }
}

}  // namespace pagekv
