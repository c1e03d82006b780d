// OpenRegularFile (regular_file.h).
#include "base/regular_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace pagekv {

Result<RegularFile> OpenRegularFile(const std::string& path, const std::string& what, int64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    const std::string msg = "cannot open " + what + " '" + path + "': " + std::strerror(err);
    return err == ENOENT ? NotFoundError(msg) : IoError(msg);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string msg = "cannot stat " + what + " '" + path + "': " + std::strerror(errno);
    ::close(fd);
    return IoError(msg);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    const char* kind = S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                       : S_ISDIR(st.st_mode) ? "a directory" : S_ISSOCK(st.st_mode) ? "a socket" : "not a regular file";
    return InvalidArgumentError(what + " '" + path + "' is " + kind + "; give a regular file");
  }
  if (st.st_size > max_bytes) {
    ::close(fd);
    return InvalidArgumentError(what + " '" + path + "' has " + std::to_string(st.st_size) + " bytes; at most " +
                                std::to_string(max_bytes) + " are read for one");
  }
  // Regular files never block; reads go on as usual.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return RegularFile{fd, static_cast<int64_t>(st.st_size)};
}

}  // namespace pagekv
