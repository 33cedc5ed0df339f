#!/usr/bin/env python3
"""The `gguf` package's (gguf-py's) quantized formats, as an outside reference for metashard's
block formats (src/dtype/). It shares no code with metashard.

    quants_ref.py sizes TYPE...           JSON {type: [block size, bytes per block]} (GGML_QUANT_SIZES)
    quants_ref.py dequant DIR TYPE...     DIR/TYPE.bin (whole blocks) -> DIR/TYPE.py.f32
    quants_ref.py quant DIR TYPE...       DIR/input.f32 -> DIR/TYPE.py.bin (gguf.quants.quantize)
    quants_ref.py tensors GGUF            JSON, one entry per tensor: name, type, shape and the
                                          CRC-32 of its values dequantized to little-endian float32
                                          (tensor infos walked from the file, see tensor_infos)

TYPE is ggml's lower-case name (q4_k). gguf-py has no Q8_K dequantizer (an activation type that
files do not hold); for it, `dequant` computes d * q with numpy from the layout of ggml-common.h
(`block_q8_K`: f32 d, 256 int8 quants, 16 int16 sums).

The checksum is zlib's CRC-32 (IEEE 802.3) of the float32 bytes, row chunk by row chunk.
Exits with status 2 and a one-line message on bad input.
"""
import json
import struct
import sys
import zlib

import numpy as np

try:
    import gguf
    from gguf.quants import dequantize, quantize
except ImportError as e:  # the caller reports a missing package as a skip or a failure
    print(f"quants_ref.py: error: ModuleNotFoundError: {e}", file=sys.stderr)
    sys.exit(3)

T = gguf.GGMLQuantizationType


def die(msg):
    print(f"quants_ref.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def qtype(name):
    try:
        return T[name.upper()]
    except KeyError:
        die(f"unknown type {name!r}")


def dequant_q8_k(raw):
    blocks = raw.reshape(-1, 292)
    d = blocks[:, :4].copy().view(np.float32)
    q = blocks[:, 4:260].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(-1)


def cmd_sizes(types):
    print(json.dumps({t: list(gguf.GGML_QUANT_SIZES[qtype(t)]) for t in types}))


def cmd_dequant(d, types):
    for t in types:
        raw = np.fromfile(f"{d}/{t}.bin", dtype=np.uint8)
        qt = qtype(t)
        if qt == T.Q8_K:
            out = dequant_q8_k(raw)
        else:
            ts = gguf.GGML_QUANT_SIZES[qt][1]
            out = dequantize(raw.reshape(-1, ts), qt).reshape(-1)
        out.astype(np.float32).tofile(f"{d}/{t}.py.f32")


def cmd_quant(d, types):
    x = np.fromfile(f"{d}/input.f32", dtype=np.float32)
    for t in types:
        qt = qtype(t)
        bs = gguf.GGML_QUANT_SIZES[qt][0]
        quantize(x.reshape(-1, bs), qt).tofile(f"{d}/{t}.py.bin")


SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # bytes


def tensor_infos(path):
    """(alignment-resolved data offset, [(name, type, ne, relative offset)]) of a GGUF file,
    walked from the layout of ggml's docs/gguf.md. gguf-py's GGUFReader builds every metadata
    value as numpy views, which takes about 15 s for a 262,144-token vocabulary; this walk
    skips the values (reading `general.alignment` only)."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v[0]

    def string():
        nonlocal pos
        n = take("<Q")
        pos += n
        return bytes(buf[pos - n:pos]).decode("utf-8")

    def skip(vtype):
        nonlocal pos
        if vtype in SCALAR:
            pos += SCALAR[vtype]
        elif vtype == 8:
            n = take("<Q")
            pos += n
        elif vtype == 9:
            etype, count = take("<I"), take("<Q")
            if etype in SCALAR:
                pos += SCALAR[etype] * count
            else:
                for _ in range(count):
                    skip(etype)
        else:
            die(f"{path}: unknown value type {vtype} at byte {pos}")

    if bytes(buf[:4]) != b"GGUF":
        die(f"{path}: not a GGUF file")
    pos = 4
    version, n_tensors, n_kv = take("<I"), take("<Q"), take("<Q")
    if version not in (2, 3):
        die(f"{path}: GGUF version {version}")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = string(), take("<I")
        if key == "general.alignment" and vtype == 4:
            alignment = take("<I")
        else:
            skip(vtype)
    infos = []
    for _ in range(n_tensors):
        name = string()
        ne = [take("<Q") for _ in range(take("<I"))]
        infos.append((name, take("<I"), ne, take("<Q")))
    return buf, (pos + alignment - 1) // alignment * alignment, infos


def cmd_tensors(path):
    buf, data, infos = tensor_infos(path)
    out = []
    for name, ttype, ne, offset in infos:
        qt = T(ttype)
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        row_bytes = ne[0] // bs * ts
        n_rows = int(np.prod(ne[1:], dtype=np.int64))
        rows = buf[data + offset:data + offset + n_rows * row_bytes].reshape(n_rows, row_bytes)
        crc, n = 0, 0
        for lo in range(0, n_rows, 2048):
            v = np.ascontiguousarray(dequantize(rows[lo:lo + 2048], qt), dtype="<f4")
            crc = zlib.crc32(memoryview(v).cast("B"), crc)
            n += v.size
        out.append({"name": name, "type": ttype, "ne": ne, "elements": n, "crc32": crc})
    print(json.dumps(out))


def main(argv):
    if len(argv) < 2:
        die("usage: quants_ref.py sizes|dequant|quant|tensors ...")
    cmd, args = argv[1], argv[2:]
    if cmd == "sizes":
        cmd_sizes(args)
    elif cmd == "dequant" and args:
        cmd_dequant(args[0], args[1:])
    elif cmd == "quant" and args:
        cmd_quant(args[0], args[1:])
    elif cmd == "tensors" and len(args) == 1:
        cmd_tensors(args[0])
    else:
        die(f"bad arguments: {' '.join(argv[1:])}")


if __name__ == "__main__":
    main(sys.argv)
