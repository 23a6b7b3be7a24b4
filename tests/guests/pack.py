#!/usr/bin/env python3
"""Package the tvm-testguest ELF in the other forms the VMM boots.

usage:
  pack.py bzimage GUEST_ELF OUT   wrap the guest as a bzImage (Linux boot protocol 2.15,
                                  XLF_KERNEL_64): the protected-mode part is the guest's
                                  flat image for load address 0x100000, whose byte +0x200 is
                                  the guest's 64-bit bzImage entry stub.
  pack.py no-pvh GUEST_ELF OUT    copy the ELF with its PT_NOTE turned into PT_NULL, so a
                                  loader finds no PVH note and takes the 64-bit ELF entry.

Errors name the problem and exit with status 1. Only the Python standard library is used.
"""
import struct
import sys

PT_LOAD = 1
PT_NOTE = 4
PT_NULL = 0
LOAD_ADDRESS = 0x100000
SETUP_SECTS = 1  # one setup sector after the boot sector: 1 KiB of real-mode part
HEADER_VERSION = 0x020F
XLF_KERNEL_64 = 1 << 0
LOADED_HIGH = 1 << 0


class PackError(Exception):
    """A problem with the input, worded for the person running the tool."""


def read_elf(data):
    """Returns (entry, program headers as dicts, phoff, phentsize) of an x86-64 ELF."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise PackError("not an ELF file; build the guest with scripts/build-test-guests.sh")
    if data[4] != 2 or data[5] != 1:
        raise PackError("not a little-endian 64-bit ELF")
    (machine,) = struct.unpack_from("<H", data, 18)
    if machine != 62:
        raise PackError(f"ELF machine {machine} is not x86-64 (62)")
    entry, phoff = struct.unpack_from("<QQ", data, 24)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    if phentsize != 56 or phoff + phnum * phentsize > len(data):
        raise PackError("ELF program header table is truncated or malformed")
    phdrs = []
    for i in range(phnum):
        off = phoff + i * phentsize
        p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, _align = struct.unpack_from(
            "<IIQQQQQQ", data, off
        )
        phdrs.append(
            dict(index_offset=off, type=p_type, offset=p_offset, paddr=p_paddr, filesz=p_filesz, memsz=p_memsz)
        )
    return entry, phdrs


def flat_image(data, phdrs):
    """Lays the PT_LOAD segments out as one image starting at LOAD_ADDRESS.

    Returns (image bytes, memory size including .bss)."""
    loads = [p for p in phdrs if p["type"] == PT_LOAD]
    if not loads:
        raise PackError("ELF has no PT_LOAD segment")
    base = min(p["paddr"] for p in loads)
    if base != LOAD_ADDRESS:
        raise PackError(f"guest is linked at {base:#x}; the bzImage packaging needs {LOAD_ADDRESS:#x}")
    file_end = max(p["paddr"] + p["filesz"] for p in loads)
    mem_end = max(p["paddr"] + p["memsz"] for p in loads)
    image = bytearray(file_end - base)
    for p in loads:
        if p["offset"] + p["filesz"] > len(data):
            raise PackError("a PT_LOAD segment runs past the end of the file")
        start = p["paddr"] - base
        image[start : start + p["filesz"]] = data[p["offset"] : p["offset"] + p["filesz"]]
    return bytes(image), mem_end - base


def bzimage(data):
    """Builds the bzImage bytes for the guest ELF `data`."""
    _entry, phdrs = read_elf(data)
    image, mem_size = flat_image(data, phdrs)
    if len(image) < 0x210 or image[0x200] != 0xFA:  # the stub starts with cli
        raise PackError("no 64-bit entry stub at +0x200 of the image (expected `cli`); rebuild the guest")
    pm = image + b"\0" * (-len(image) % 16)
    setup = bytearray(512 * (SETUP_SECTS + 1))
    struct.pack_into("<B", setup, 0x1F1, SETUP_SECTS)  # setup_sects
    struct.pack_into("<H", setup, 0x1F2, 0)  # root_flags
    struct.pack_into("<I", setup, 0x1F4, len(pm) // 16)  # syssize, 16-byte units
    struct.pack_into("<H", setup, 0x1FA, 0xFFFF)  # vid_mode: normal
    struct.pack_into("<H", setup, 0x1FE, 0xAA55)  # boot_flag
    # The real-mode entry (jump at 0x200) is not supported: it jumps to `hlt`.
    real_mode_stop = 0x270
    struct.pack_into("<BB", setup, 0x200, 0xEB, real_mode_stop - 0x202)
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", setup, 0x206, HEADER_VERSION)
    struct.pack_into("<H", setup, 0x20C, 0x1000)  # start_sys_seg (obsolete)
    struct.pack_into("<B", setup, 0x211, LOADED_HIGH)  # loadflags
    struct.pack_into("<I", setup, 0x214, LOAD_ADDRESS)  # code32_start
    struct.pack_into("<I", setup, 0x22C, 0x7FFFFFFF)  # initrd_addr_max
    struct.pack_into("<I", setup, 0x230, 0x200000)  # kernel_alignment
    struct.pack_into("<B", setup, 0x234, 0)  # relocatable_kernel: no, load at code32_start
    struct.pack_into("<B", setup, 0x235, 21)  # min_alignment (log2)
    struct.pack_into("<H", setup, 0x236, XLF_KERNEL_64)  # xloadflags
    struct.pack_into("<I", setup, 0x238, 2047)  # cmdline_size
    struct.pack_into("<Q", setup, 0x258, LOAD_ADDRESS)  # pref_address
    struct.pack_into("<I", setup, 0x260, (mem_size + 0xFFF) & ~0xFFF)  # init_size
    setup[real_mode_stop : real_mode_stop + 3] = bytes([0xF4, 0xEB, 0xFD])  # hlt; jmp $-1
    return bytes(setup) + pm


def no_pvh(data):
    """Returns the ELF with every PT_NOTE program header turned into PT_NULL."""
    _entry, phdrs = read_elf(data)
    notes = [p for p in phdrs if p["type"] == PT_NOTE]
    if not notes:
        raise PackError("ELF has no PT_NOTE; it already lacks the PVH note")
    out = bytearray(data)
    for p in notes:
        struct.pack_into("<I", out, p["index_offset"], PT_NULL)
    return bytes(out)


def main(argv):
    if len(argv) != 4 or argv[1] not in ("bzimage", "no-pvh"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        with open(argv[2], "rb") as f:
            data = f.read()
        out = bzimage(data) if argv[1] == "bzimage" else no_pvh(data)
    except (OSError, PackError) as e:
        print(f"pack.py: {argv[2]}: {e}", file=sys.stderr)
        return 1
    tmp = argv[3] + ".tmp"
    with open(tmp, "wb") as f:
        f.write(out)
    import os

    os.replace(tmp, argv[3])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
