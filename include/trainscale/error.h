#pragma once

#include <stdexcept>
#include <string>

namespace trainscale {

// Every failure TrainScale reports: invalid arguments (the message names the op, the
// argument, what was expected and what was given), missing CUDA support, CUDA errors.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A forced kernel variant (NormVariant) that cannot run these arguments, which are otherwise
// valid: the automatic choice would have taken another variant.
class UnsupportedVariantError : public Error {
 public:
  using Error::Error;
};

}  // namespace trainscale
