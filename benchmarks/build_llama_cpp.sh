#!/usr/bin/env bash
# llama.cpp's own tools (llama-bench, llama-batched-bench, llama-server), built once
# from the sources vendored in llama-cpp-python's sdist: the same llama.cpp the
# ctypes peer (llama_cpp_peer.py) runs, so the two peers can be checked against
# each other. A benchmark-only extra, never part of the test install.
#
#     benchmarks/build_llama_cpp.sh        # both cores for a few minutes
#
# Built with -DGGML_NATIVE=ON for the CPU it runs on, into $LLAMA_CPP_HOME
# (default ~/.cache/gpt2-max/llama.cpp-<version>), outside the repository; prints
# the folder holding the binaries. A second run with the binaries present does
# nothing.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/gpt2-max"
HOME_DIR="${LLAMA_CPP_HOME:-$CACHE/llama.cpp-$VERSION}"
BIN="$HOME_DIR/build/bin"
TARGETS=(llama-bench llama-batched-bench llama-server)

have_all() {
    for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done
}

if have_all; then
    echo "$BIN"
    exit 0
fi

command -v cmake >/dev/null || { echo "cmake is missing: apt-get install cmake" >&2; exit 1; }
mkdir -p "$HOME_DIR"
SDIST_DIR="$HOME_DIR/sdist"
if [[ ! -d "$HOME_DIR/src" ]]; then
    rm -rf "$SDIST_DIR"
    python -m pip download --no-deps --no-binary :all: --dest "$SDIST_DIR" \
        "llama-cpp-python==$VERSION" >&2
    tmp="$(mktemp -d "$HOME_DIR/extract.XXXXXX")"
    tar -xzf "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
    # The sdist vendors llama.cpp under vendor/llama.cpp.
    mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$HOME_DIR/src"
    rm -rf "$tmp"
fi

cmake -S "$HOME_DIR/src" -B "$HOME_DIR/build" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON >&2
cmake --build "$HOME_DIR/build" --config Release -j "$(nproc)" --target "${TARGETS[@]}" >&2
have_all || { echo "build finished without all of: ${TARGETS[*]}" >&2; exit 1; }
echo "$BIN"
