// Model and tokenizer paths that are not what they claim: a FIFO, a device,
// a directory, or a llama2.c checkpoint whose header does not account for
// the file exactly. Each is an error at once naming the file, never a
// blocked open, an endless read or a model of garbage weights.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include <gtest/gtest.h>

#include "model/model_loader.h"

namespace pagekv {
namespace {

constexpr const char* kBin = "../shared/models/stories260K/stories260K.bin";
constexpr const char* kTok = "../shared/models/stories260K/tok512.bin";

std::string Temp(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("pagekv-modelfile-" + std::to_string(::getpid()) + "-" + name))
      .string();
}

TEST(ModelFilesTest, AFifoADeviceOrADirectoryIsRefusedAtOnce) {
  const std::string fifo = Temp("fifo");
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {fifo, std::string("/dev/zero"), std::filesystem::temp_directory_path().string()}) {
    Result<LoadedModel> m = LoadModel(path, kTok);  // a FIFO used to block here for ever
    ASSERT_FALSE(m.ok()) << path;
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << m.status().ToString();
    EXPECT_NE(m.status().message().find("give a regular file"), std::string::npos) << m.status().ToString();
    Result<LoadedModel> t = LoadModel(kBin, path);  // /dev/zero used to be read without end
    ASSERT_FALSE(t.ok()) << path;
    EXPECT_NE(t.status().message().find("tokenizer"), std::string::npos) << t.status().ToString();
  }
  std::filesystem::remove(fifo);
}

TEST(ModelFilesTest, ALlama2cHeaderMustAccountForTheWholeFile) {
  ASSERT_TRUE(LoadModel(kBin, kTok).ok());
  std::ifstream in(kBin, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  const std::string longer = Temp("longer.bin");
  {
    std::ofstream out(longer, std::ios::binary);
    out << bytes << std::string(4096, '\x01');  // a header for a smaller model than the file
  }
  Result<LoadedModel> m = LoadModel(longer, kTok);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(m.status().message().find("its header describes"), std::string::npos) << m.status().ToString();
  const std::string shorter = Temp("shorter.bin");
  {
    std::ofstream out(shorter, std::ios::binary);
    out << bytes.substr(0, bytes.size() - 4);
  }
  EXPECT_NE(LoadModel(shorter, kTok).status().message().find("truncated"), std::string::npos);
  std::filesystem::remove(longer);
  std::filesystem::remove(shorter);
}

}  // namespace
}  // namespace pagekv
