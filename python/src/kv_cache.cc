// pagekv.KvCache: the paged block pool with its block tables (pagekv/kv_cache.h)
// from Python, rows in and out as NumPy arrays, and a block's slab of one
// (layer, K/V, head) as a view into the arena (NumPy, or any DLPack
// consumer) without a copy.
//
// Rows cross the boundary as [num_layers][num_tokens][num_heads][row] arrays,
// the layout of KvTokens: float32 / float16 elements for f32 / f16 caches,
// uint16 bit patterns for bf16 (NumPy has no bfloat16), float16 for INT4
// KIVI layers (rows are exchanged unquantized there), and the stored bytes
// (uint8, the row's scale included) for int8 / fp8.
#include "kv_cache.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <unordered_set>

#include "buffer.h"
#include "config.h"
#include "errors.h"
#include "pagekv/dtype.h"
#include "pagekv/kv_cache.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace pagekv::python {
namespace {

// How one layer's rows are exchanged with Python.
struct RowType {
  nb::dlpack::dtype dtype;  // element type of the array
  int64_t elems = 0;        // elements per row
};

RowType ExchangeType(const KvLayout& layout, int32_t layer) {
  const KvFormat& f = layout.format(layer);
  const int64_t row_bytes = layout.row_bytes(layer);
  if (f.IsKivi()) return {nb::dtype<uint16_t>(), row_bytes / 2};  // replaced by float16 below
  switch (f.dtype) {
    case DType::kF32: return {nb::dtype<float>(), row_bytes / 4};
    case DType::kF16:
    case DType::kBF16: return {nb::dtype<uint16_t>(), row_bytes / 2};
    default: return {nb::dtype<uint8_t>(), row_bytes};
  }
}

bool IsFloat16(const KvLayout& layout, int32_t layer) {
  const KvFormat& f = layout.format(layer);
  return f.IsKivi() || f.dtype == DType::kF16;
}

nb::dlpack::dtype Float16() { return {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1}; }
nb::dlpack::dtype BFloat16() { return {static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1}; }

std::string DtypeName(nb::dlpack::dtype d) {
  const char* kind = d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float)    ? "float"
                     : d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt)   ? "uint"
                     : d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int)    ? "int"
                     : d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) ? "bfloat"
                                                                                       : "other";
  return std::string(kind) + std::to_string(d.bits);
}

// The array type rows are exchanged in for every layer (they must agree).
struct Exchange {
  nb::dlpack::dtype dtype;
  int64_t elems = 0;
  int64_t elem_bytes = 0;
};

Exchange ExchangeOf(const KvLayout& layout) {
  Exchange e;
  for (int32_t l = 0; l < layout.num_layers(); ++l) {
    RowType t = ExchangeType(layout, l);
    if (IsFloat16(layout, l)) t.dtype = Float16();
    if (l == 0) {
      e = {t.dtype, t.elems, t.dtype.bits / 8};
    } else if (t.dtype != e.dtype || t.elems != e.elems) {
      Raise(Status(StatusCode::kUnimplemented,
                   "this cache's layers exchange rows of different types (layer 0: " + std::to_string(e.elems) + " " +
                       DtypeName(e.dtype) + ", layer " + std::to_string(l) + ": " + std::to_string(t.elems) + " " +
                       DtypeName(t.dtype) + "); rows of mixed per-layer formats cannot travel as one array yet"));
    }
  }
  return e;
}

using InArray = nb::ndarray<nb::c_contig, nb::device::cpu>;

// Checks one [num_layers][n][num_heads][elems] array; returns n.
int64_t CheckRows(const InArray& a, const char* name, const KvLayout& layout, const Exchange& e) {
  const int64_t want[4] = {layout.num_layers(), -1, layout.num_heads(), e.elems};
  auto shape_text = [&] {
    return "[num_layers=" + std::to_string(want[0]) + "][num_tokens][num_heads=" + std::to_string(want[2]) +
           "][" + std::to_string(want[3]) + "]";
  };
  if (a.ndim() != 4) {
    RaiseInvalid(std::string(name) + ": an array of 4 dimensions " + shape_text() + " is needed, got " +
                 std::to_string(a.ndim()));
  }
  for (int i = 0; i < 4; ++i) {
    if (want[i] >= 0 && static_cast<int64_t>(a.shape(i)) != want[i]) {
      RaiseInvalid(std::string(name) + ": dimension " + std::to_string(i) + " is " + std::to_string(a.shape(i)) +
                   ", the cache needs " + shape_text());
    }
  }
  if (a.dtype() != e.dtype) {
    RaiseInvalid(std::string(name) + ": elements of type " + DtypeName(a.dtype()) + ", this " +
                 layout.format(0).ToString() + " cache exchanges rows as " + DtypeName(e.dtype) +
                 (layout.format(0).dtype == DType::kBF16 ? " (bfloat16 bit patterns: NumPy has no bfloat16)" : ""));
  }
  return static_cast<int64_t>(a.shape(1));
}

// A fresh NumPy array that owns its buffer.
template <typename T>
nb::ndarray<nb::numpy> NewArray(std::vector<size_t> shape, nb::dlpack::dtype dtype) {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  auto* data = new T[n > 0 ? n : 1]();
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy>(data, shape.size(), shape.data(), owner, nullptr, dtype);
}

nb::ndarray<nb::numpy> NewRows(const Exchange& e, const KvLayout& layout, int64_t n) {
  std::vector<size_t> shape = {static_cast<size_t>(layout.num_layers()), static_cast<size_t>(n),
                               static_cast<size_t>(layout.num_heads()), static_cast<size_t>(e.elems)};
  switch (e.elem_bytes) {
    case 4: return NewArray<float>(shape, e.dtype);
    case 2: return NewArray<uint16_t>(shape, e.dtype);
    default: return NewArray<uint8_t>(shape, e.dtype);
  }
}

SeqId Seq(int64_t id) { return SeqId{id}; }

nb::dict StatsDict(const CacheStats& s) {
  nb::dict d;
  d["blocks_total"] = s.blocks_total;
  d["blocks_free"] = s.blocks_free;
  d["blocks_cached_free"] = s.blocks_cached_free;
  d["blocks_used"] = s.blocks_used;
  d["blocks_shared"] = s.blocks_shared;
  d["num_sequences"] = s.num_sequences;
  d["tokens_logical"] = s.tokens_logical;
  d["tokens_physical"] = s.tokens_physical;
  d["bytes_pool"] = s.bytes_pool;
  d["bytes_allocated"] = s.bytes_allocated;
  d["bytes_holding_tokens"] = s.bytes_holding_tokens;
  d["internal_fragmentation"] = s.internal_fragmentation;
  d["utilization"] = s.utilization;
  return d;
}

nb::dict SequenceDict(const SequenceStats& s) {
  nb::dict d;
  d["id"] = ToInt(s.id);
  d["label"] = s.label;
  d["num_tokens"] = s.num_tokens;
  d["num_blocks"] = s.num_blocks;
  d["num_shared_blocks"] = s.num_shared_blocks;
  d["bytes_allocated"] = s.bytes_allocated;
  d["bytes_holding_tokens"] = s.bytes_holding_tokens;
  return d;
}

}  // namespace

PyKvCache::PyKvCache(const GeometryArgs& geometry, bool huge_pages, bool prefault) {
  Geometry g = BuildGeometry(geometry);
  if (g.config.num_blocks == 0 && g.config.budget_bytes == 0) {
    RaiseInvalid("no pool size: give num_blocks=N or budget=BYTES (an int or a string such as \"64MiB\")");
  }
  KvCacheOptions options;
  options.config = std::move(g.config);
  options.huge_pages = huge_pages;
  options.prefault = prefault;
  cache_ = Take(KvCache::Create(options));
}

PyKvCache::~PyKvCache() = default;

KvCache& PyKvCache::cache() { return *cache_; }

const KvCache& PyKvCache::cache() const { return *cache_; }

void BindKvCache(nb::module_& m) {
  nb::class_<PyKvCache>(m, "KvCache",
                        "The paged KV cache: one preallocated arena of fixed-size blocks, per-sequence block tables,\n"
                        "fork with copy-on-write, truncate and free returning blocks at once. Not thread-safe: one\n"
                        "thread uses it at a time (the GIL serialises calls from Python).")
      .def(
          "__init__",
          [](PyKvCache* self, std::optional<std::string> preset, std::optional<int64_t> num_layers,
             std::optional<int64_t> num_q_heads, std::optional<int64_t> num_kv_heads, std::optional<int64_t> head_dim,
             std::optional<int64_t> kv_lora_rank, std::optional<int64_t> rope_dim, std::optional<int64_t> block_len,
             std::optional<std::string> dtype, std::optional<std::string> layer_dtypes,
             std::optional<int64_t> num_blocks, std::optional<ByteSize> budget, bool huge_pages, bool prefault) {
            GeometryArgs a{preset,   num_layers, num_q_heads, num_kv_heads, head_dim,   kv_lora_rank,
                           rope_dim, block_len,  dtype,       layer_dtypes, num_blocks, budget};
            new (self) PyKvCache(a, huge_pages, prefault);
          },
          nb::kw_only(), "preset"_a = nb::none(), "num_layers"_a = nb::none(), "num_q_heads"_a = nb::none(),
          "num_kv_heads"_a = nb::none(), "head_dim"_a = nb::none(), "kv_lora_rank"_a = nb::none(),
          "rope_dim"_a = nb::none(), "block_len"_a = nb::none(), "dtype"_a = nb::none(),
          "layer_dtypes"_a = nb::none(), "num_blocks"_a = nb::none(), "budget"_a = nb::none(),
          "huge_pages"_a = false, "prefault"_a = true,
          "A cache of a preset's geometry (pagekv.presets()) or of the given one; the pool is num_blocks\n"
          "blocks or as many as fit in budget (bytes, or a string such as \"64MiB\").")
      // --- geometry -------------------------------------------------------
      .def_prop_ro("num_layers", [](const PyKvCache& c) { return c.cache().layout().num_layers(); })
      .def_prop_ro("num_heads", [](const PyKvCache& c) { return c.cache().layout().num_heads(); },
                   "KV heads stored (1 for an MLA cache).")
      .def_prop_ro("row_elems", [](const PyKvCache& c) { return c.cache().layout().row_elems(); },
                   "Elements of one row: head_dim, or kv_lora_rank + rope_dim for MLA.")
      .def_prop_ro("block_len", [](const PyKvCache& c) { return c.cache().layout().block_len(); })
      .def_prop_ro("num_blocks", [](const PyKvCache& c) { return c.cache().layout().num_blocks(); })
      .def_prop_ro("format", [](const PyKvCache& c) { return c.cache().layout().format(0).ToString(); },
                   "Layer 0's storage format, e.g. \"f16\".")
      .def_prop_ro("bytes_per_block", [](const PyKvCache& c) { return c.cache().layout().bytes_per_block(); })
      .def_prop_ro("bytes_per_token", [](const PyKvCache& c) { return c.cache().layout().bytes_per_token(); })
      .def_prop_ro("block_payload_bytes", [](const PyKvCache& c) { return c.cache().block_payload_bytes(); },
                   "Bytes of one block as tiers store it (ReadBlock / WriteBlock).")
      // --- sequences ------------------------------------------------------
      .def("add_sequence", [](PyKvCache& c, const std::string& label) { return ToInt(c.cache().AddSequence(label)); },
           "label"_a = "", "A new, empty sequence holding no blocks; returns its id.")
      .def("__contains__", [](const PyKvCache& c, int64_t id) { return c.cache().Contains(Seq(id)); }, "seq"_a)
      .def("__len__", [](const PyKvCache& c) { return c.cache().num_sequences(); })
      .def("length", [](const PyKvCache& c, int64_t id) { return Take(c.cache().View(Seq(id))).num_tokens; }, "seq"_a,
           "Tokens the sequence holds.")
      .def(
          "blocks_needed",
          [](const PyKvCache& c, int64_t id, int64_t n) {
            const AppendNeed need = Take(c.cache().BlocksNeeded(Seq(id), n));
            return std::make_pair(need.new_blocks, need.copy_on_write);
          },
          "seq"_a, "n"_a,
          "What appending n tokens would take, changing nothing: (new blocks, whether the shared partly\n"
          "filled last block must be copied first).")
      .def(
          "append",
          [](PyKvCache& c, int64_t id, const InArray& k, std::optional<InArray> v) {
            const KvLayout& layout = c.cache().layout();
            const Exchange e = ExchangeOf(layout);
            const int64_t n = CheckRows(k, "k", layout, e);
            const bool mla = layout.num_planes() == 1;
            if (mla && v) RaiseInvalid("v: an MLA cache holds one latent row per token; pass k only");
            if (!mla && !v) RaiseInvalid("v: missing; a per-head cache needs the V rows too");
            if (v && CheckRows(*v, "v", layout, e) != n) {
              RaiseInvalid("k holds " + std::to_string(n) + " tokens and v " + std::to_string(v->shape(1)) +
                           ": they must hold the same tokens");
            }
            return Take(c.cache().Append(Seq(id), KvTokens{n, k.data(), v ? v->data() : nullptr}));
          },
          "seq"_a, "k"_a, "v"_a = nb::none(),
          "Appends the tokens of k and v ([num_layers][n][num_heads][row] arrays) through the write path.\n"
          "Returns False, changing nothing, when the pool lacks the blocks.")
      .def(
          "read",
          [](const PyKvCache& c, int64_t id, int64_t begin, std::optional<int64_t> count) {
            const KvLayout& layout = c.cache().layout();
            const Exchange e = ExchangeOf(layout);
            const int64_t len = Take(c.cache().View(Seq(id))).num_tokens;
            const int64_t n = count ? *count : len - begin;
            if (begin < 0 || n < 0 || begin + n > len) {
              Raise(Status(StatusCode::kOutOfRange, "read: tokens [" + std::to_string(begin) + ", " +
                                                        std::to_string(begin + n) + ") outside the sequence's " +
                                                        std::to_string(len)));
            }
            auto k = NewRows(e, layout, n);
            const bool mla = layout.num_planes() == 1;
            std::optional<nb::ndarray<nb::numpy>> v;
            if (!mla) v = NewRows(e, layout, n);
            Check(c.cache().Read(Seq(id), begin, KvTokensOut{n, k.data(), v ? v->data() : nullptr}));
            return std::make_pair(k, v);
          },
          "seq"_a, "begin"_a = 0, "count"_a = nb::none(),
          "Copies tokens [begin, begin + count) out: (k, v) arrays shaped as append takes them (v None for MLA).")
      .def("fork", [](PyKvCache& c, int64_t id, const std::string& label) { return ToInt(Take(c.cache().Fork(Seq(id), label))); },
           "seq"_a, "label"_a = "", "A new sequence sharing every block of seq; allocates nothing.")
      .def("truncate", [](PyKvCache& c, int64_t id, int64_t n) { Check(c.cache().Truncate(Seq(id), n)); }, "seq"_a,
           "length"_a, "Shortens seq to length tokens; blocks left empty go back to the pool.")
      .def("free", [](PyKvCache& c, int64_t id) { Check(c.cache().Free(Seq(id))); }, "seq"_a,
           "Releases every block of seq and forgets it.")
      .def(
          "read_block",
          [](const PyKvCache& c, int32_t block) {
            const int64_t n = c.cache().block_payload_bytes();
            PyObject* b = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(n));
            if (b == nullptr) throw nb::python_error();
            nb::bytes out = nb::steal<nb::bytes>(b);
            Check(c.cache().ReadBlock(BlockId{block},
                                      {reinterpret_cast<std::byte*>(PyBytes_AS_STRING(b)), static_cast<size_t>(n)}));
            return out;
          },
          "block"_a,
          "A copy of the whole block (every layer, K and V, every head: block_payload_bytes bytes), the\n"
          "payload a BlockStore keeps.")
      .def(
          "write_block",
          [](PyKvCache& c, int64_t id, int64_t index, nb::handle data) {
            Buffer buf(data, "data");
            Check(c.cache().WriteBlock(Seq(id), index, buf.bytes()));
          },
          "seq"_a, "index"_a, "data"_a,
          "Overwrites block `index` of seq's table (every slot) with a payload read_block or a store gave.\n"
          "Refused for a block shared with another sequence or published (FailedPreconditionError).")
      .def(
          "block_table",
          [](const PyKvCache& c, int64_t id) {
            const SequenceView view = Take(c.cache().View(Seq(id)));
            std::vector<int32_t> out;
            out.reserve(view.blocks.size());
            for (BlockId b : view.blocks) out.push_back(ToInt(b));
            return out;
          },
          "seq"_a, "The sequence's block ids, position p in block table[p // block_len].")
      .def("ref_count", [](const PyKvCache& c, int32_t block) { return c.cache().BlockRefCount(BlockId{block}); },
           "block"_a, "How many sequences hold block (0 when free).")
      // --- accounting -----------------------------------------------------
      .def("stats", [](const PyKvCache& c) { return StatsDict(c.cache().Stats()); }, "The pool's counters, as a dict.")
      .def("sequence_stats", [](const PyKvCache& c, int64_t id) { return SequenceDict(Take(c.cache().StatsFor(Seq(id)))); },
           "seq"_a)
      .def("memory_report", [](const PyKvCache& c) { return c.cache().Memory().ToString(); },
           "What the stored tokens need, what the pool holds, what is handed out: a small table.")
      .def("leak_report", [](const PyKvCache& c) { return c.cache().LeakReport(); },
           "Every block still referenced and by whom; \"no blocks referenced\" when clean.")
      .def("check_invariants", &CheckInvariants,
           "Raises pagekv.InternalError naming the first broken invariant: reference counts equal the\n"
           "tables holding each block, free + used = total, a sequence of n tokens holds ceil(n / block_len)\n"
           "blocks, no block twice in one table.")
      // --- zero-copy views ------------------------------------------------
      .def("block_view", &BlockView, "block"_a, "layer"_a, "head"_a = 0, "plane"_a = "k", "writable"_a = false,
           "The slab of (block, layer, plane, head) in the arena as a NumPy array [block_len, row] without\n"
           "a copy (see block_dlpack for the element types). Read-only unless writable=True, which is\n"
           "refused for a block that is free, shared (ref_count > 1) or published to a prefix cache. The\n"
           "view keeps the cache alive; after free or truncate it shows whatever the block holds next.")
      .def("block_dlpack", &BlockDlpack, "block"_a, "layer"_a, "head"_a = 0, "plane"_a = "k", "writable"_a = false,
           "The same slab as an object with __dlpack__ / __dlpack_device__ (numpy.from_dlpack,\n"
           "torch.from_dlpack); bf16 slabs are bfloat16 here, uint16 bit patterns in block_view.");
}

void CheckInvariants(const PyKvCache& c) {
  const KvCache& cache = c.cache();
  auto broken = [](const std::string& what) { Raise(Status(StatusCode::kInternal, "invariant broken: " + what)); };
  const CacheStats s = cache.Stats();
  if (s.blocks_free + s.blocks_used != s.blocks_total) {
    broken("free (" + std::to_string(s.blocks_free) + ") + used (" + std::to_string(s.blocks_used) +
           ") != total (" + std::to_string(s.blocks_total) + ")");
  }
  std::vector<int32_t> refs(static_cast<size_t>(s.blocks_total), 0);
  const int64_t bl = cache.layout().block_len();
  for (const SequenceStats& q : cache.AllSequenceStats()) {
    const SequenceView v = Take(cache.View(q.id));
    if (static_cast<int64_t>(v.blocks.size()) != (v.num_tokens + bl - 1) / bl) {
      broken("sequence " + std::to_string(ToInt(q.id)) + " holds " + std::to_string(v.blocks.size()) +
             " blocks for " + std::to_string(v.num_tokens) + " tokens");
    }
    std::unordered_set<int32_t> seen;
    for (BlockId b : v.blocks) {
      if (ToInt(b) < 0 || ToInt(b) >= s.blocks_total) broken("a block table holds id " + std::to_string(ToInt(b)));
      if (!seen.insert(ToInt(b)).second) {
        broken("block " + std::to_string(ToInt(b)) + " twice in sequence " + std::to_string(ToInt(q.id)));
      }
      ++refs[static_cast<size_t>(ToInt(b))];
    }
  }
  for (int32_t b = 0; b < s.blocks_total; ++b) {
    if (cache.BlockRefCount(BlockId{b}) != refs[static_cast<size_t>(b)]) {
      broken("block " + std::to_string(b) + " has reference count " + std::to_string(cache.BlockRefCount(BlockId{b})) +
             " but " + std::to_string(refs[static_cast<size_t>(b)]) + " tables hold it");
    }
  }
}

SlabRef Slab(PyKvCache& c, int32_t block, int32_t layer, int32_t head, const std::string& plane, bool writable) {
  const KvLayout& layout = c.cache().layout();
  if (block < 0 || block >= layout.num_blocks()) {
    Raise(Status(StatusCode::kOutOfRange, "block " + std::to_string(block) + " outside the pool [0, " +
                                              std::to_string(layout.num_blocks()) + ")"));
  }
  if (layer < 0 || layer >= layout.num_layers()) {
    Raise(Status(StatusCode::kOutOfRange, "layer " + std::to_string(layer) + " outside [0, " +
                                              std::to_string(layout.num_layers()) + ")"));
  }
  if (head < 0 || head >= layout.num_heads()) {
    Raise(Status(StatusCode::kOutOfRange,
                 "head " + std::to_string(head) + " outside [0, " + std::to_string(layout.num_heads()) + ")"));
  }
  int32_t p = 0;
  if (plane == "v") {
    p = 1;
  } else if (plane != "k") {
    RaiseInvalid("plane \"" + plane + "\": \"k\" or \"v\"");
  }
  if (p >= layout.num_planes()) RaiseInvalid("plane \"v\": an MLA cache has only its latent rows, plane \"k\"");
  if (layout.format(layer).IsKivi()) {
    Raise(Status(StatusCode::kUnimplemented, "layer " + std::to_string(layer) +
                                                 " is INT4 KIVI: its slabs are packed codes with per-group "
                                                 "parameters, not rows; read() returns its rows as float16"));
  }
  if (writable) {
    const int32_t refs = c.cache().BlockRefCount(BlockId{block});
    if (refs != 1 || c.cache().IsBlockCached(BlockId{block})) {
      Raise(Status(StatusCode::kFailedPrecondition,
                   "block " + std::to_string(block) +
                       (refs == 0  ? " is free"
                        : refs > 1 ? " is shared by " + std::to_string(refs) + " sequences"
                                   : " is published to a prefix cache") +
                       ": its rows must not change, so a writable view is refused (fork copies on write; "
                       "write through the sequence that holds the block alone)"));
    }
  }
  RowType t = ExchangeType(layout, layer);
  if (layout.format(layer).dtype == DType::kF16) t.dtype = Float16();
  // The arena is writable memory; the const is the library's promise to
  // kernels that read it.
  auto* data = const_cast<std::byte*>(c.cache().arena()) + layout.SlabOffset(layer, p, head, block);
  return {data, t.dtype, layout.block_len(), t.elems, layout.row_bytes(layer) / (t.dtype.bits / 8),
          layout.format(layer).dtype == DType::kBF16};
}

nb::object BlockView(PyKvCache& c, int32_t block, int32_t layer, int32_t head, const std::string& plane,
                     bool writable) {
  const SlabRef s = Slab(c, block, layer, head, plane, writable);
  const size_t shape[2] = {static_cast<size_t>(s.rows), static_cast<size_t>(s.elems)};
  const int64_t strides[2] = {s.row_stride, 1};
  nb::handle owner = nb::find(&c);
  if (writable) return nb::cast(nb::ndarray<nb::numpy>(s.data, 2, shape, owner, strides, s.dtype));
  return nb::cast(nb::ndarray<nb::numpy, nb::ro>(s.data, 2, shape, owner, strides, s.dtype));
}

nb::object BlockDlpack(PyKvCache& c, int32_t block, int32_t layer, int32_t head, const std::string& plane,
                       bool writable) {
  const SlabRef s = Slab(c, block, layer, head, plane, writable);
  const size_t shape[2] = {static_cast<size_t>(s.rows), static_cast<size_t>(s.elems)};
  const int64_t strides[2] = {s.row_stride, 1};
  const nb::dlpack::dtype dtype = s.bf16 ? BFloat16() : s.dtype;
  nb::handle owner = nb::find(&c);
  // array_api: an object with __dlpack__ / __dlpack_device__ (a bare
  // capsule would be the old protocol, which numpy.from_dlpack refuses).
  if (writable) return nb::cast(nb::ndarray<nb::array_api>(s.data, 2, shape, owner, strides, dtype));
  return nb::cast(nb::ndarray<nb::array_api, nb::ro>(s.data, 2, shape, owner, strides, dtype));
}

}  // namespace pagekv::python
