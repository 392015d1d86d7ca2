#!/usr/bin/env bash
# Build llama-cpp-python once into a cached wheel, and llama.cpp's own `llama-server` from the same sources,
# keeping llama.cpp's GGUF converter beside them.
#
#     benchmarks/build_llama_cpp.sh [WHEEL_DIR]       # default: $MLXCHAT_WHEELS or ~/.cache/mlxchat/wheels
#     pip install WHEEL_DIR/llama_cpp_python-*.whl
#     export LLAMA_CPP_DIR=WHEEL_DIR/llama.cpp-<version>   # convert_hf_to_gguf.py, conversion/, gguf-py/,
#                                                          # bin/llama-server
#     LLAMA_CPP_PARTS=server benchmarks/build_llama_cpp.sh # only the converter and llama-server
#
# The compile runs under `nice -n 19` with one compile job at a time (llama-server: LLAMA_CPP_JOBS), so that
# other work on the machine keeps a core (about 7 minutes on a 2-core Sapphire Rapids-class VM without the
# multimodal library; the full default build takes ~20; llama-server alone about 15 minutes of CPU on a
# 2-core EPYC). Nothing of llama.cpp lands in this repository.
#
# Build flags, and why:
# - GGML_NATIVE=ON: ggml's CPU kernels for this machine's instruction set (AVX2/AVX-512/VNNI...), the
#   configuration llama.cpp's users normally run.
# - -mno-amx-tile -mno-amx-int8 -mno-amx-bf16: on a CPU with AMX, -march=native compiles ggml's AMX
#   backend in, and llama.cpp then repacks Q4_0/Q4_1/Q8_0/K-quant weights into an "AMX" buffer (F32/F16
#   never use it: that is why only the quantized rows crashed). Its first matmul segfaults in
#   ggml_backend_amx_mul_mat at `ldtilecfg` (SIGSEGV, si_code SI_KERNEL: a #GP). Cause: GCC 12's
#   _tile_loadconfig (amxtileintrin.h) is inline asm whose memory operand is `*(const void **)config`,
#   8 bytes, so the optimizer deletes the stores that fill the rest of ggml's 64-byte tile configuration
#   and the instruction loads stack garbage (the disassembly keeps only the palette byte and a 32-byte
#   zeroing). Whether it crashes depends on that garbage and on the compiler, hence "works on another
#   machine" (ggml-org/llama.cpp#20824). Keeping AMX out leaves every other -march=native feature on,
#   including the CPU_REPACK path that interleaves Q4_0 for AVX-512.
# - LLAVA_BUILD=OFF: the multimodal library (mtmd) is not used by the benchmark; skipping it saves time.
# - llama-server: LLAMA_BUILD_UI=OFF and LLAMA_USE_PREBUILT_UI=OFF (its web page is fetched from the network
#   otherwise; the benchmark only calls the API), no curl or OpenSSL (it loads a local file), static
#   libraries so that the one binary can be copied out of the build tree.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
WHEELS="${1:-${MLXCHAT_WHEELS:-$HOME/.cache/mlxchat/wheels}}"
PYTHON="${PYTHON:-python}"
mkdir -p "$WHEELS/src"
WHEELS="$(cd "$WHEELS" && pwd)"

sdist="$WHEELS/src/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
    "$PYTHON" -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$WHEELS/src"
fi

# The converter is plain Python from the same llama.cpp sources as the wheel.
converter="$WHEELS/llama.cpp-$VERSION"
if [ ! -f "$converter/convert_hf_to_gguf.py" ]; then
    mkdir -p "$converter"
    top="llama_cpp_python-$VERSION/vendor/llama.cpp"
    tar -xzf "$sdist" -C "$converter" --strip-components=3 \
        "$top/convert_hf_to_gguf.py" "$top/conversion" "$top/gguf-py" "$top/LICENSE"
fi

PARTS="${LLAMA_CPP_PARTS:-wheel server}"
export CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
export CXXFLAGS="$CFLAGS"

if [[ " $PARTS " == *" server "* ]]; then
    if [ -x "$converter/bin/llama-server" ]; then
        echo "already built: $converter/bin/llama-server"
    else
        source="$WHEELS/src/llama.cpp-$VERSION"
        mkdir -p "$source"
        tar -xzf "$sdist" -C "$source" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
        cmake -S "$source" -B "$source/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
            -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >/dev/null
        nice -n 19 cmake --build "$source/build" --target llama-server -j "${LLAMA_CPP_JOBS:-1}"
        mkdir -p "$converter/bin"
        cp "$source/build/bin/llama-server" "$converter/bin/llama-server"
        rm -rf "$source"
    fi
    echo "server:    $converter/bin/llama-server"
fi
[[ " $PARTS " == *" wheel "* ]] || { echo "converter: export LLAMA_CPP_DIR=$converter"; exit 0; }

if ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
    echo "already built: $(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl)"
else
    export CMAKE_BUILD_PARALLEL_LEVEL=1
    export CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
    nice -n 19 "$PYTHON" -m pip wheel --no-deps -w "$WHEELS" "$sdist"
fi
echo "wheel:     $(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl)"
echo "converter: export LLAMA_CPP_DIR=$converter"
