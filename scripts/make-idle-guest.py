#!/usr/bin/env python3
"""Writes a tiny x86_64 ELF guest kernel for tenantvm-vmm: it prints one line to COM1
and then halts with interrupts off, so it idles without using CPU until the VMM stops it.

The demo, the orchestrator's end-to-end tests and the benchmark use it as a stand-in
until the no_std test guests (tests/guests, scripts/build-test-guests.sh) are built.

usage: scripts/make-idle-guest.py OUT [MESSAGE]
"""
import struct
import sys

LOAD = 0x100000
CODE_OFFSET = 0x1000


def code(message: bytes) -> bytes:
    body = bytes([
        0x66, 0xBA, 0xF8, 0x03,              # mov dx, 0x3f8
        0x48, 0x8D, 0x35, 12, 0, 0, 0,       # lea rsi, [rip + 12] (the message)
        0xAC,                                # lodsb
        0x84, 0xC0,                          # test al, al
        0x74, 0x03,                          # jz halt
        0xEE,                                # out dx, al
        0xEB, 0xF8,                          # jmp lodsb
        0xFA,                                # halt: cli
        0xF4,                                # hlt
        0xEB, 0xFC,                          # jmp halt
    ])
    assert len(body) == 23
    return body + message + b"\0"


def elf(text: bytes, memsz: int = 0x1000) -> bytes:
    hdr = b"\x7fELF\x02\x01\x01" + b"\0" * 9
    hdr += struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, LOAD, 64, 0, 0, 64, 56, 1, 64, 0, 0)
    ph = struct.pack("<IIQQQQQQ", 1, 7, CODE_OFFSET, LOAD, LOAD, len(text),
                     max(memsz, len(text)), 0x1000)
    img = hdr + ph
    img += b"\0" * (CODE_OFFSET - len(img))
    return img + text


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    message = (sys.argv[2] if len(sys.argv) == 3 else "tenantvm idle guest: hello") + "\n"
    with open(sys.argv[1], "wb") as f:
        f.write(elf(code(message.encode())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
