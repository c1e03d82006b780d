// PageKV embedded in another program, built against an installed PageKV
// (find_package(PageKV) or pkg-config; examples/embed/CMakeLists.txt):
// two requests that share a prompt prefix run through the engine, the
// second finds the first's blocks in the prefix cache.
//
//   embed MODEL.gguf
#include <cstdio>
#include <string>

#include <pagekv/pagekv.h>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s MODEL.gguf\n", argv[0]);
    return 2;
  }
  pagekv::EngineOptions o;
  o.model_path = argv[1];
  o.num_blocks = 64;
  o.prefix_cache = true;
  pagekv::Result<std::unique_ptr<pagekv::Engine>> engine = pagekv::Engine::Create(o);
  if (!engine.ok()) {
    std::fprintf(stderr, "error: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  const std::string shared = "Once upon a time there was a little girl named Lily. She liked to play in the park";
  for (const char* tail : {" with her ball.", " with her dog."}) {
    pagekv::EngineRequest r;
    r.prompt = (*engine)->Encode(shared + tail);
    r.max_tokens = 12;
    pagekv::Result<pagekv::RequestId> id = (*engine)->Submit(std::move(r));
    if (!id.ok() || !(*engine)->RunUntilIdle().ok()) {
      std::fprintf(stderr, "error: %s\n", id.ok() ? "step failed" : id.status().ToString().c_str());
      return 1;
    }
    const pagekv::RequestResult res = (*engine)->Wait(*id);
    std::printf("prompt %lld tokens, %lld from the prefix cache: %s\n", static_cast<long long>(res.prompt_tokens),
                static_cast<long long>(res.cached_prompt_tokens), res.text.c_str());
  }
  std::printf("pagekv %s\n", PAGEKV_VERSION);
  return 0;
}
