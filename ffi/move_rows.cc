// Rows of several caches moved within each batch row, on the CPU: for every cache [B, S, C] (one dtype, any width C)
// and row b, the rows at slots starts[b] + clamp(path[b, j], 0, n_nodes - 1) (j < P) are read first, then written at
// slots d + j, d = clamp(starts[b], 0, S - P). After a tree step this puts the accepted nodes' latents next to the
// prefix (model.move_accepted), every layer's two caches in one call. The caches are aliased to the results (in
// place); a source slot past the cache is clamped to its last slot (the loop's cache always has room for the tree).
// move_rows.cu is the same on CUDA.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using I32Mat = ffi::Buffer<ffi::S32, 2>;
using I32Vec = ffi::Buffer<ffi::S32, 1>;

namespace kdtree {
namespace {

ffi::Error MoveRows(I32Vec starts, I32Mat path, ffi::RemainingArgs caches, ffi::RemainingRets outs,
                    int64_t n_nodes) {
  const int64_t b = path.dimensions()[0], p = path.dimensions()[1];
  if (starts.dimensions()[0] != b || n_nodes < 1 || caches.size() != outs.size()) {
    return ffi::Error::InvalidArgument("move_rows: starts [B], path [B, P], n_nodes >= 1, one result per cache");
  }
  std::vector<char> stage;
  for (size_t c = 0; c < caches.size(); ++c) {
    auto in = caches.get<ffi::AnyBuffer>(c);
    auto out = outs.get<ffi::AnyBuffer>(c);
    if (!in.has_value() || !out.has_value()) return ffi::Error::InvalidArgument("move_rows: a cache is not a buffer");
    const auto dims = in->dimensions();
    if (dims.size() != 3 || dims[0] != b || dims[1] < p || (*out)->dimensions().size() != 3 ||
        (*out)->size_bytes() != in->size_bytes() || (*out)->element_type() != in->element_type()) {
      return ffi::Error::InvalidArgument("move_rows: cache " + std::to_string(c) +
                                         " must be [B, S, C] with S >= P, its result the same");
    }
    const int64_t s = dims[1];
    const size_t row = in->size_bytes() / static_cast<size_t>(b * s);
    char* data = static_cast<char*>((*out)->untyped_data());
    if (data != in->untyped_data()) std::memcpy(data, in->untyped_data(), in->size_bytes());
    stage.resize(static_cast<size_t>(p) * row);
    for (int64_t r = 0; r < b; ++r) {
      char* base = data + static_cast<size_t>(r * s) * row;
      const int64_t st = starts.typed_data()[r];
      for (int64_t j = 0; j < p; ++j) {
        const int64_t node = std::clamp<int64_t>(path.typed_data()[r * p + j], 0, n_nodes - 1);
        const int64_t src = std::clamp<int64_t>(st + node, 0, s - 1);
        std::memcpy(stage.data() + j * row, base + src * row, row);
      }
      const int64_t dst = std::clamp<int64_t>(st, 0, s - p);
      std::memcpy(base + dst * row, stage.data(), static_cast<size_t>(p) * row);
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdMoveRowsCpu, kdtree::MoveRows,
                              ffi::Ffi::Bind()
                                  .Arg<I32Vec>()            // starts [B]
                                  .Arg<I32Mat>()            // path [B, P], node indices (clamped to 0 .. n_nodes - 1)
                                  .RemainingArgs()          // caches [B, S, C_i], aliased to the results
                                  .RemainingRets()          // the same caches, rows moved
                                  .Attr<int64_t>("n_nodes"));  // the tree's nodes (root included)
