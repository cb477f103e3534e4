// The TMA descriptors' view of the attention family's [B, S, H, D] tensors (forward and Hopper
// backward launchers).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "trainscale/tensor.h"

namespace trainscale::ops::attention {

// A [B, S, H, D] view as the (S, D, H, B) tensor the TMA descriptor describes. The stride of a
// dim of size 1 is never used; it is replaced by one TMA accepts.
template <class Element>
auto tma_view(const TensorView& t) {
  using namespace cute;
  auto stride_of = [&](int dim) { return t.size(dim) == 1 ? t.size(3) : t.strides[dim]; };
  return make_tensor(make_gmem_ptr(static_cast<const Element*>(t.data)),
                     make_layout(make_shape(static_cast<int32_t>(t.size(1)), static_cast<int32_t>(t.size(3)),
                                            static_cast<int32_t>(t.size(2)), static_cast<int32_t>(t.size(0))),
                                 make_stride(stride_of(1), _1{}, stride_of(2), stride_of(0))));
}

}  // namespace trainscale::ops::attention
