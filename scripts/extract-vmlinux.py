#!/usr/bin/env python3
"""Extracts the ELF vmlinux from a bzImage.

The bzImage's payload is the compressed, stripped vmlinux (ELF notes included, so the
PVH entry note survives). This finds the payload through the setup header
(payload_offset/payload_length, boot protocol 2.08+) and decompresses it.

usage: extract-vmlinux.py BZIMAGE OUTPUT
"""
import gzip
import lzma
import struct
import sys


def decompress(data: bytes) -> bytes:
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data)
    if data[:4] == b"\x28\xb5\x2f\xfd":
        # The kernel's build appends the uncompressed size (4 bytes, little endian) after
        # the zstd frame; zstd reads those bytes as a truncated second frame and fails.
        import subprocess
        run = subprocess.run(["zstd", "-dc"], input=data[:-4], capture_output=True)
        if run.returncode != 0:
            raise SystemExit(f"zstd -dc failed: {run.stderr.decode(errors='replace').strip()}")
        return run.stdout
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    raise SystemExit(f"unknown payload compression (magic {data[:6].hex()})")


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    image = open(sys.argv[1], "rb").read()
    if image[0x202:0x206] != b"HdrS":
        raise SystemExit(f"{sys.argv[1]}: not a bzImage (no HdrS setup header)")
    setup_sects = image[0x1F1] or 4
    payload_offset, payload_length = struct.unpack_from("<II", image, 0x248)
    start = (setup_sects + 1) * 512 + payload_offset
    elf = decompress(image[start:start + payload_length])
    if elf[:4] != b"\x7fELF":
        raise SystemExit("decompressed payload is not an ELF file")
    with open(sys.argv[2], "wb") as out:
        out.write(elf)
    print(f"extract-vmlinux: {len(elf)} bytes of ELF vmlinux")


if __name__ == "__main__":
    main()
