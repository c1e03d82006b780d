#include "testing/file_digest.h"

#include <openssl/evp.h>

#include <cstdio>
#include <fstream>
#include <sstream>

namespace pagekv::testing {

std::string FileSha256Hex(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  std::stringstream bytes;
  bytes << in.rdbuf();
  const std::string s = bytes.str();
  unsigned char digest[32];
  unsigned int len = 0;
  EVP_Digest(s.data(), s.size(), digest, &len, EVP_sha256(), nullptr);
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) {
    char b[3];
    std::snprintf(b, sizeof(b), "%02x", digest[i]);
    hex += b;
  }
  return hex;
}

}  // namespace pagekv::testing
