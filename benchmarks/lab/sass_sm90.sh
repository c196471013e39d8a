#!/usr/bin/env bash
# The wgmma decode kernel's SASS on a machine without a GPU: compiles TREE/csrc/mla_decode_sm90.cu
# for sm_90a (nvcc here; torch's headers from the venv's torch, CPU wheel or not) and prints, for
# each kernel instantiation, its instruction count, branches and spills; with a name filter also
# that kernel's SASS into OUT.sass. cuobjdump is not in the CUDA install here: it comes from
# PyPI's wheel (pip download --no-deps nvidia-cuda-cuobjdump; unzip; set CUOBJDUMP to its bin/cuobjdump).
#   CUOBJDUMP=/tmp/nvd/x/nvidia/cu13/bin/cuobjdump bash benchmarks/lab/sass_sm90.sh . /tmp/main 'nv_bfloat16LNS_11CacheFormatE0ELb0E'
# Compile: ~1 minute. A run compares two trees by their counts (or `diff` of the two .sass files);
# whether a change moved the hot loop's layout shows there before any GPU time is spent.
set -eu
tree=$1 out=$2 filter=${3:-}
py=${PYTHON:-python3}
inc=$($py -c "import sysconfig, torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths() + [sysconfig.get_paths()['include']]))")
# torch's CPU wheel lacks this CUDA build header; an empty one lets the CUDA headers parse
fake=$(mktemp -d) && trap 'rm -rf "$fake"' EXIT
mkdir -p "$fake/c10/cuda/impl" && echo '#pragma once' > "$fake/c10/cuda/impl/cuda_cmake_macros.h"
# shellcheck disable=SC2086  # the include flags, split as written
nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a $inc -I"$fake" -I"$tree/csrc" -DTORCH_EXTENSION_NAME=sass \
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
  -D__CUDA_NO_HALF2_OPERATORS__ -c "$tree/csrc/mla_decode_sm90.cu" -o "$out.o" -Xptxas -v 2> "$out.ptxas.log"
"${CUOBJDUMP:-cuobjdump}" -sass "$out.o" > "$out.all.sass"
$py - "$out" "$filter" <<'PY'
import re, sys
out, want = sys.argv[1], sys.argv[2]
text = open(out + ".all.sass").read()
spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", open(out + ".ptxas.log").read())
print(f"spill stores / loads over all kernels: {sum(int(a) for a, _ in spills)} / {sum(int(b) for _, b in spills)}")
for part in re.split(r"\n\s*Function : ", text)[1:]:
    name, body = part.split("\n", 1)
    count = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", body, re.M))
    branches = len(re.findall(r"\sBRA[\s.]", body))
    short = re.search(r"mla_decode_sm90_kernelI(\w+?)EEv", name)
    print(f"{short[1] if short else name}: {count} instructions, {branches} branches")
    if want and want in name:
        open(out + ".sass", "w").write(body)
        print(f"  wrote {out}.sass")
PY
