// Opening an input file that must be a regular file: a FIFO, a socket or a
// device (/dev/zero) given as a model, tokenizer or trace is an error at
// once, never a read that blocks or does not end.
#pragma once

#include <cstdint>
#include <string>

#include "pagekv/status.h"

namespace pagekv {

struct RegularFile {
  int fd = -1;        // the caller closes it
  int64_t size = 0;
};

// Opens `path` read-only without blocking (O_NONBLOCK: a FIFO is not waited
// on) and checks that it is a regular file of at most max_bytes. `what`
// names the file in errors ("model file", "tokenizer"): kNotFound when it
// does not exist, kInvalidArgument when it is not a regular file or too
// large, kIoError otherwise.
Result<RegularFile> OpenRegularFile(const std::string& path, const std::string& what,
                                    int64_t max_bytes = int64_t{1} << 40);

}  // namespace pagekv
