// Secrets for the CLI (API keys, the tier key, the Redis password): read
// from an environment variable or a file, never taken from a flag's value
// (which shows in ps, shell history and logs).
#pragma once

#include <string>
#include <vector>

namespace pagekv::cli {

// The secret in `path`: a regular file of at most 64 KiB (a FIFO, a device
// such as /dev/zero or a huge file is refused before anything is read);
// one trailing newline (\n or \r\n) is dropped. Warns on stderr when the
// file is readable by group or others. false after printing an error that
// names `flag`; an empty secret is an error too.
bool ReadSecretFile(const std::string& flag, const std::string& path, std::string& out);

// The value of environment variable `name`: false (after an error naming
// `flag`) when it is unset or empty.
bool ReadSecretEnv(const std::string& flag, const std::string& name, std::string& out);

// Splits a list of secrets, one per line (blank lines and lines starting
// with '#' skipped; surrounding spaces trimmed).
std::vector<std::string> SecretLines(const std::string& text);

}  // namespace pagekv::cli
