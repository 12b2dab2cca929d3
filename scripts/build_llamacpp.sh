#!/usr/bin/env bash
# Builds llama.cpp's own tools, the peers of scripts/bench_llamacpp.py, from
# the llama.cpp that the pinned llama-cpp-python release vendors.
#
# The sdist (from the package index, or --sdist=FILE) carries llama.cpp
# under vendor/llama.cpp with examples/speculative, speculative-simple and
# lookup. The build is "native minus AMX": GGML_NATIVE=OFF with each of
# ggml's x86 options (GGML_AVX2, GGML_AVX512_VNNI, ...) turned on where
# /proc/cpuinfo lists the feature, except GGML_AMX_*: on the Xeon VM of
# scripts/bench_llamacpp.py's AMX_NOTE, a -march=native build (AMX_INT8 =
# 1) dies with SIGILL in ggml-cpu's AMX kernels on its first decode (--amx
# turns them on, to check that). These options reach only ggml-cpu, so
# rebuilding with other ones recompiles only that library.
# Shared libraries go beside the tools, so llama-cpp-python can load the
# same build (--python installs it into the active environment without
# building llama.cpp again; then run with LLAMA_CPP_LIB_PATH=DIR, which
# scripts/bench_llamacpp.py sets itself).
#
# Usage: scripts/build_llamacpp.sh [--sdist=FILE] [--amx] [--python]
#            [--jobs=N] [DIR]
#   DIR  where the tools and libraries go (default
#        ~/.cache/specjax/llamacpp). The build tree is DIR/build.
# Takes about 15 minutes on 2 cores; `nice -n 10` it on a shared machine.

set -euo pipefail

version="$(sed -n 's/^ *llama-cpp-python==\([0-9.]*\).*/\1/p' \
  "$(dirname "$0")/../setup.cfg" | head -n 1)"
sdist=""
amx=0
python=0
jobs=2
out="${HOME}/.cache/specjax/llamacpp"
for arg in "$@"; do
  case "${arg}" in
    --sdist=*) sdist="${arg#--sdist=}" ;;
    --amx) amx=1 ;;
    --python) python=1 ;;
    --jobs=*) jobs="${arg#--jobs=}" ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    -*) echo "unknown flag ${arg}" >&2; exit 2 ;;
    *) out="${arg}" ;;
  esac
done
mkdir -p "${out}"
out="$(cd "${out}" && pwd)"

if [[ -z "${sdist}" ]]; then
  sdist="${out}/llama_cpp_python-${version}.tar.gz"
  if [[ ! -f "${sdist}" ]]; then
    python3 -m pip download "llama-cpp-python==${version}" \
      --no-binary :all: --no-deps -d "${out}"
  fi
fi
src="${out}/src"
stamp="$(basename "${sdist}") $(stat -c %s "${sdist}")"
if [[ "$(cat "${src}/.sdist" 2>/dev/null)" != "${stamp}" ]]; then
  rm -rf "${src}" "${out}/build"
  mkdir -p "${src}"
  tar -xzf "${sdist}" -C "${src}" --strip-components=1
  echo "${stamp}" > "${src}/.sdist"
fi
llama="${src}/vendor/llama.cpp"
for example in speculative speculative-simple lookup simple; do
  if [[ ! -d "${llama}/examples/${example}" ]]; then
    echo "the sdist has no examples/${example}" >&2
  fi
done

# ggml's x86 option for each CPU feature (the AVX512 one wants all five).
cpu_flags=" $(grep -m 1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() {
  for f in "$@"; do [[ "${cpu_flags}" == *" ${f} "* ]] || return 1; done
}
isa=()
for pair in SSE42:sse4_2 F16C:f16c FMA:fma BMI2:bmi2 AVX:avx AVX2:avx2 \
    AVX_VNNI:avx_vnni "AVX512:avx512f avx512cd avx512vl avx512dq avx512bw" \
    AVX512_VBMI:avx512vbmi AVX512_VNNI:avx512_vnni \
    AVX512_BF16:avx512_bf16 AMX_TILE:amx_tile AMX_INT8:amx_int8 \
    AMX_BF16:amx_bf16; do
  option="${pair%%:*}"
  # shellcheck disable=SC2086
  if has ${pair#*:} && [[ "${option}" != AMX_* || "${amx}" == 1 ]]; then
    isa+=("-DGGML_${option}=ON")
  else
    isa+=("-DGGML_${option}=OFF")
  fi
done
cmake_args=(
  -G Ninja -DCMAKE_BUILD_TYPE=Release
  -DGGML_NATIVE=OFF "${isa[@]}"
  -DBUILD_SHARED_LIBS=ON
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON "-DCMAKE_INSTALL_RPATH=\$ORIGIN"
  -DGGML_CCACHE=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
)
targets=(llama-speculative llama-speculative-simple llama-lookup
         llama-simple llama-completion)
build="${out}/build"
cmake -S "${llama}" -B "${build}" "${cmake_args[@]}"
cmake --build "${build}" -j "${jobs}" --target "${targets[@]}"
cp -a "${build}"/bin/*.so* "${out}/"
for target in "${targets[@]}"; do
  cp -a "${build}/bin/${target}" "${out}/"
done

{
  echo "llama_cpp_python=${version}"
  echo "cmake_args=${cmake_args[*]}"
  echo "amx=${amx}"
} > "${out}/BUILD_INFO"

if [[ "${python}" == 1 ]]; then
  # The Python bindings alone: they load DIR/libllama.so at run time.
  CMAKE_ARGS="-DLLAMA_BUILD=OFF" python3 -m pip install \
    --force-reinstall "${sdist}"
fi

echo "llama.cpp ${version}'s tools and libraries are in ${out}:"
ls "${out}" | grep -E '^(llama-|lib)' | tr '\n' ' '
echo
echo "build flags: ${cmake_args[*]}"
