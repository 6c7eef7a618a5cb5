"""Resource use read from a cubin itself, for a compile whose ptxas log does not say it: an entry function's
register count and stack frame, from the ELF's `.nv.info` attributes (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE).
Spill bytes are not recorded there (they live inside the frame), so this does not replace the log's report.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

EIFMT_SVAL = 4            # a record with a 16-bit size and that many payload bytes
EIATTR_FRAME_SIZE = 0x11  # payload: function symbol index, frame bytes
EIATTR_REGCOUNT = 0x2F    # payload: function symbol index, registers


@dataclass(frozen=True)
class FunctionResources:
    registers: int
    frame_bytes: int


def _sections(data: bytes) -> list[tuple[str, int, int, int]]:
    """(name, offset, size, link) of each section of a little-endian ELF64 file, in section-index order (a
    section's `link` is such an index)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    entsize, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQII", data, shoff + i * entsize) for i in range(count)]
    names_at = heads[names_index][4]

    def name(off: int) -> str:
        end = data.index(b"\0", names_at + off)
        return data[names_at + off:end].decode()
    return [(name(h[0]), h[4], h[5], h[6]) for h in heads]


def function_resources(cubin: bytes, kernel: str) -> FunctionResources | None:
    """The registers and stack frame the cubin records for entry function `kernel`; None when the cubin does
    not name them (or cannot be read)."""
    try:
        secs = _sections(cubin)
        _, sym_at, sym_size, strtab_index = next(s for s in secs if s[0] == ".symtab")
        str_at = secs[strtab_index][1]

        def symbol(i: int) -> str:
            if not 0 <= i < sym_size // 24:
                return ""
            off = str_at + struct.unpack_from("<I", cubin, sym_at + 24 * i)[0]
            return cubin[off:cubin.index(b"\0", off)].decode()
        found = {}
        for sec, at, size, _ in secs:
            if not sec.startswith(".nv.info"):
                continue
            p, end = at, at + size
            while p + 4 <= end:
                fmt, attr, value = struct.unpack_from("<BBH", cubin, p)
                p += 4
                if fmt != EIFMT_SVAL:
                    continue
                if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and value >= 8:
                    index, amount = struct.unpack_from("<II", cubin, p)
                    if symbol(index) == kernel:
                        found[attr] = amount
                p += value
        if EIATTR_REGCOUNT not in found:
            return None
        return FunctionResources(found[EIATTR_REGCOUNT], found.get(EIATTR_FRAME_SIZE, 0))
    except (ValueError, StopIteration, IndexError, struct.error, UnicodeDecodeError):
        return None
