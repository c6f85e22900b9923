#!/usr/bin/env python3
"""make-vhd-child.py PARENT.vhd PARENT.raw CHILD.vhd CHILD.raw SEED

Writes CHILD.vhd, a differencing VHD (disk type 4) over the dynamic VHD PARENT.vhd, holding
a few runs of random sectors (some unaligned, one crossing a block boundary), and CHILD.raw,
what the child reads over its parent: PARENT.raw with those sectors overlaid. qemu-img
cannot create differencing VHDs, so the e2e tests make them with this, after the VHD
specification (footer, dynamic header, BAT, blocks with a sector bitmap).
"""
import os
import random
import struct
import sys

SECTOR = 512


def checksum(b, at):
    b[at:at + 4] = b"\0\0\0\0"
    b[at:at + 4] = struct.pack(">I", ~sum(b) & 0xFFFFFFFF)


def main():
    parent_vhd, parent_raw, child_vhd, child_raw, seed = sys.argv[1:6]
    rnd = random.Random(int(seed))
    p = open(parent_vhd, "rb").read()
    pf = bytearray(p[-512:])
    assert pf[:8] == b"conectix" and struct.unpack_from(">I", pf, 60)[0] in (3, 4), "parent is not a dynamic VHD"
    size = struct.unpack_from(">Q", pf, 48)[0]
    pdyn = p[struct.unpack_from(">Q", pf, 16)[0]:][:1024]
    entries, block = struct.unpack_from(">I", pdyn, 28)[0], struct.unpack_from(">I", pdyn, 32)[0]
    per_block = block // SECTOR
    bitmap_len = ((per_block + 7) // 8 + SECTOR - 1) // SECTOR * SECTOR

    guest = bytearray(open(parent_raw, "rb").read())
    assert len(guest) == size, (len(guest), size)
    runs = []
    for _ in range(5):
        first = rnd.randrange(0, size // SECTOR - 64)
        runs.append((first, rnd.randrange(1, 40)))
    runs.append((per_block - 3, 7))  # crosses the boundary of blocks 0 and 1
    present = {}
    for first, n in runs:
        data = os.urandom(n * SECTOR)
        guest[first * SECTOR:(first + n) * SECTOR] = data
        for k in range(n):
            present[first + k] = data[k * SECTOR:(k + 1) * SECTOR]

    bat_at = 512 + 1024
    bat_len = -(-entries * 4 // SECTOR) * SECTOR
    out = bytearray(bat_at + bat_len)
    bat = [0xFFFFFFFF] * entries
    for b in sorted({s // per_block for s in present}):
        bat[b] = len(out) // SECTOR
        bm = bytearray(bitmap_len)
        blk = bytearray(block)
        for s in range(b * per_block, (b + 1) * per_block):
            if s in present:
                k = s - b * per_block
                bm[k // 8] |= 0x80 >> (k % 8)
                blk[k * SECTOR:(k + 1) * SECTOR] = present[s]
        out += bm + blk
    for i, s in enumerate(bat):
        struct.pack_into(">I", out, bat_at + 4 * i, s)

    footer = bytearray(pf)
    struct.pack_into(">Q", footer, 16, 512)  # data offset: the dynamic header
    struct.pack_into(">I", footer, 60, 4)  # differencing
    footer[68:84] = os.urandom(16)  # unique id
    checksum(footer, 64)
    dyn = bytearray(1024)
    dyn[:8] = b"cxsparse"
    struct.pack_into(">Q", dyn, 8, 0xFFFFFFFFFFFFFFFF)
    struct.pack_into(">Q", dyn, 16, bat_at)
    struct.pack_into(">I", dyn, 24, 0x00010000)
    struct.pack_into(">I", dyn, 28, entries)
    struct.pack_into(">I", dyn, 32, block)
    dyn[40:56] = pf[68:84]  # the parent's unique id
    name = os.path.basename(parent_vhd).encode("utf-16-be")
    dyn[64:64 + len(name)] = name
    checksum(dyn, 36)
    out[:512] = footer
    out[512:1536] = dyn
    out += footer
    open(child_vhd, "wb").write(out)
    open(child_raw, "wb").write(guest)


main()
