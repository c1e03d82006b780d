// Secrets from files and the environment (secrets.h).
#include "secrets.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace pagekv::cli {

bool ReadSecretFile(const std::string& flag, const std::string& path, std::string& out) {
  constexpr off_t kMax = 64 << 10;
  // O_NONBLOCK: opening a FIFO does not wait for a writer (it is refused below).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    std::fprintf(stderr, "error: %s '%s': %s\n", flag.c_str(), path.c_str(), std::strerror(errno));
    return false;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > kMax) {
    std::fprintf(stderr, "error: %s '%s': %s\n", flag.c_str(), path.c_str(),
                 !S_ISREG(st.st_mode) ? "not a regular file (give a file holding the secret)"
                                      : "larger than 64 KiB (a secret file holds the secret alone)");
    ::close(fd);
    return false;
  }
  if ((st.st_mode & 077) != 0) {
    std::fprintf(stderr, "warning: %s '%s' is readable by other users (chmod 600 it)\n", flag.c_str(), path.c_str());
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  for (ssize_t n; got < text.size() && (n = ::read(fd, text.data() + got, text.size() - got)) > 0;) {
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  text.resize(got);
  if (!text.empty() && text.back() == '\n') text.pop_back();
  if (!text.empty() && text.back() == '\r') text.pop_back();
  if (text.empty()) {
    std::fprintf(stderr, "error: %s '%s' is empty\n", flag.c_str(), path.c_str());
    return false;
  }
  out = std::move(text);
  return true;
}

bool ReadSecretEnv(const std::string& flag, const std::string& name, std::string& out) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr || *v == '\0') {
    std::fprintf(stderr, "error: %s %s: the environment variable is %s\n", flag.c_str(), name.c_str(),
                 v == nullptr ? "not set" : "empty");
    return false;
  }
  out = v;
  return true;
}

std::vector<std::string> SecretLines(const std::string& text) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(at, end - at);
    const size_t b = line.find_first_not_of(" \t\r");
    const size_t e = line.find_last_not_of(" \t\r");
    line = b == std::string::npos ? "" : line.substr(b, e - b + 1);
    if (!line.empty() && line[0] != '#') out.push_back(std::move(line));
    at = end + 1;
  }
  return out;
}

}  // namespace pagekv::cli
