#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` from the llama.cpp source that the installed
# llama-cpp-python vendors, so the bench compares specdec with the server a CPU user runs,
# on the same kernels and the same GGUF files.
#
#   benchmarks/build_llama_server.sh            # -> ~/.cache/specdec/llama-server/bin/llama-server
#   SPECDEC_LLAMA_SERVER_DIR=/opt/ls benchmarks/build_llama_server.sh
#
# The source is llama-cpp-python's source distribution of the installed version, fetched with
# pip. The build downloads nothing: the web UI and HTTPS (model downloads) are switched off.
# It took about 4 minutes on 2 idle cores here, the sdist download included. `specdec bench`
# finds the binary there (or through $SPECDEC_LLAMA_SERVER, or on $PATH) and says when it is
# missing.
set -euo pipefail

dest="${SPECDEC_LLAMA_SERVER_DIR:-$HOME/.cache/specdec/llama-server}"
version="$(python -c 'from importlib.metadata import version; print(version("llama_cpp_python"))')"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "llama-cpp-python $version: fetching its source distribution"
# --no-binary for this package only: with :all:, pip builds the build back-end's own dependencies
# from source too before it can read the source distribution's metadata (many minutes, or never).
pip download --quiet --no-deps --no-binary llama-cpp-python -d "$work" "llama-cpp-python==$version"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"

# Without llama.cpp's AMX code on x86-64, as the README's test command builds llama-cpp-python: a
# virtual machine may list AMX and not run it (docs/backends.md, the llama.cpp backend).
noamx=()
if [ "$(uname -m)" = x86_64 ]; then noamx=(-mno-amx-tile -mno-amx-int8); fi

echo "building llama-server from $src"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="${noamx[*]}" -DCMAKE_CXX_FLAGS="${noamx[*]}" \
    >"$work/cmake.log" || { cat "$work/cmake.log"; exit 1; }
cmake --build "$work/build" --target llama-server -j "$(nproc)"

mkdir -p "$dest/bin"
cp "$work/build/bin/llama-server" "$dest/bin/llama-server"
echo "llama-cpp-python $version" >"$dest/VERSION"
echo "built $dest/bin/llama-server"
