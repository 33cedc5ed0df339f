#!/usr/bin/env python3
"""Registers, spills and stack of every CUDA kernel, with no GPU.

    python3 scripts/cuda_regs.py [--arch 90] [--filter mul_mat_vec] [--ptx OUT.ptx]

Compiles src/cuda/kernels.cu + kernels_qx.cu (the one NVRTC source kernels.rs builds) with the
same options as `kernels::options` through libnvrtc (ctypes), then runs ptxas -v on the PTX and
prints one line per kernel. Both come from the PyPI wheels nvidia-cuda-nvrtc-cu12 and
nvidia-cuda-nvcc-cu12 (ptxas): `pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12`.
"""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile

import nvidia.cuda_nvcc
import nvidia.cuda_nvrtc


def pkg_dir(mod):
    return list(mod.__path__)[0]


def compile_ptx(src, arch):
    lib = ctypes.CDLL(os.path.join(pkg_dir(nvidia.cuda_nvrtc), "lib", "libnvrtc.so.12"))
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"metashard_kernels.cu", 0, None, None)
    assert rc == 0, rc
    opts = [f"--gpu-architecture=compute_{arch}", "--ftz=false", "--prec-div=true", "--prec-sqrt=true"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(f"NVRTC failed ({rc}):\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="90")
    ap.add_argument("--filter", default="")
    ap.add_argument("--ptx")
    a = ap.parse_args()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "cuda")
    src = "".join(open(os.path.join(root, f)).read() for f in ("kernels.cu", "kernels_qx.cu"))
    ptx = compile_ptx(src, a.arch)
    if a.ptx:
        open(a.ptx, "w").write(ptx)
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        open(p, "w").write(ptx)
        ptxas = os.path.join(pkg_dir(nvidia.cuda_nvcc), "bin", "ptxas")
        r = subprocess.run([ptxas, f"-arch=sm_{a.arch}", "-v", p, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(r.stderr)
    name = None
    for line in r.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
            stack = ""
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line)
        if m:
            stack = f"stack {m.group(1)} B, spills {m.group(2)} B"
        m = re.search(r"Used (\d+) registers", line)
        if m and name and a.filter in name:
            print(f"{name:40} {int(m.group(1)):4} registers  {stack}")


if __name__ == "__main__":
    main()
