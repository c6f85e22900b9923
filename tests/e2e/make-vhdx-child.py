#!/usr/bin/env python3
"""make-vhdx-child.py PARENT.vhdx PARENT.raw CHILD.avhdx CHILD.raw SEED [--dirty-log]

Writes CHILD.avhdx, a differencing VHDX (HasParent, a parent locator whose parent_linkage is
PARENT's DataWriteGuid) over PARENT.vhdx (made by qemu-img, or by this script), and
CHILD.raw, what the child reads over its parent: PARENT.raw with the child's blocks applied.
qemu-img cannot create differencing VHDX files, so the e2e tests make them with this, after
the MS-VHDX specification: file type identifier, two headers (CRC-32C; the one at 128 KiB
has the higher sequence number but a bad CRC, as after a torn write, so a reader must skip
it), two region tables, metadata (File Parameters, sizes, parent locator), a BAT with its
sector-bitmap entry, a sector bitmap block. Blocks (1 MiB each): one FULLY_PRESENT, two
adjacent PARTIALLY_PRESENT (sector runs, one crossing from one into the other), one ZERO
and one UNMAPPED (read as zeros), one UNDEFINED (read from the parent); the rest
NOT_PRESENT. --dirty-log leaves a log entry with the header's LogGuid: a log to replay.
"""
import os
import random
import struct
import sys
import uuid

KIB, MIB = 1024, 1024 * 1024
BAT_REGION = uuid.UUID("2DC27766-F623-4200-9D64-115E9BFD4A08")
METADATA_REGION = uuid.UUID("8B7CA206-4790-4B9A-B8FE-575F050F886E")
FILE_PARAMETERS = uuid.UUID("CAA16737-FA36-4D43-B3B6-33F0AA44E76B")
VIRTUAL_DISK_SIZE = uuid.UUID("2FA54224-CD1B-4876-B211-5DBED83BF4B8")
VIRTUAL_DISK_ID = uuid.UUID("BECA12AB-B2E6-4523-93EF-C309E000C746")
LOGICAL_SECTOR_SIZE = uuid.UUID("8141BF1D-A96F-4709-BA47-F233A8FAAB5F")
PHYSICAL_SECTOR_SIZE = uuid.UUID("CDA348C7-445D-4471-9CC9-E9885251C556")
PARENT_LOCATOR = uuid.UUID("A8D35F2D-B30B-454D-ABF7-D3D84834AB0C")
LOCATOR_TYPE = uuid.UUID("B04AEFB7-D19E-4A81-B789-25B8E9445913")
NOT_PRESENT, UNDEFINED, ZERO, UNMAPPED, FULLY, PARTIALLY, SB_PRESENT = 0, 1, 2, 3, 6, 7, 6

_T = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _T.append(_c)


def crc32c(b):
    c = 0xFFFFFFFF
    for x in b:
        c = _T[(c ^ x) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def seal(b):
    """Sets the CRC-32C of a header or region table (bytes 4..8, computed as zero)."""
    b[4:8] = b"\0\0\0\0"
    struct.pack_into("<I", b, 4, crc32c(b))


def parent_info(path):
    """(DataWriteGuid text, virtual size, logical sector size) of a VHDX."""
    p = open(path, "rb").read()
    assert p[:8] == b"vhdxfile", "parent is not a VHDX"
    best = None
    for at in (64 * KIB, 128 * KIB):
        h = bytearray(p[at:at + 4 * KIB])
        crc = struct.unpack_from("<I", h, 4)[0]
        h[4:8] = b"\0\0\0\0"
        if h[:4] == b"head" and crc32c(h) == crc and (best is None or struct.unpack_from("<Q", h, 8)[0] > struct.unpack_from("<Q", best, 8)[0]):
            best = h
    assert best is not None, "no valid header in the parent"
    guid = str(uuid.UUID(bytes_le=bytes(best[32:48]))).upper()
    rt = p[192 * KIB:256 * KIB]
    n = struct.unpack_from("<I", rt, 8)[0]
    meta = next(struct.unpack_from("<Q", rt, 16 + 32 * i + 16)[0] for i in range(n)
                if uuid.UUID(bytes_le=rt[16 + 32 * i:32 + 32 * i]) == METADATA_REGION)
    items = {}
    for i in range(struct.unpack_from("<H", p, meta + 10)[0]):
        e = meta + 32 + 32 * i
        items[uuid.UUID(bytes_le=p[e:e + 16])] = meta + struct.unpack_from("<I", p, e + 16)[0]
    return guid, struct.unpack_from("<Q", p, items[VIRTUAL_DISK_SIZE])[0], struct.unpack_from("<I", p, items[LOGICAL_SECTOR_SIZE])[0]


def main():
    parent, parent_raw, child, child_raw, seed = sys.argv[1:6]
    dirty = "--dirty-log" in sys.argv[6:]
    rnd = random.Random(int(seed))
    pguid, size, sector = parent_info(parent)
    block = MIB
    per_block = block // sector
    blocks = -(-size // block)
    chunk_ratio = (1 << 23) * sector // block
    assert blocks >= 8 and blocks <= chunk_ratio, "the generator makes one chunk of at least 8 blocks"
    guest = bytearray(open(parent_raw, "rb").read())
    assert len(guest) == size, (len(guest), size)

    log_at, meta_at, bat_at, sb_at, data_at = MIB, 2 * MIB, 3 * MIB, 4 * MIB, 5 * MIB
    out = bytearray(data_at)
    bat = [NOT_PRESENT] * (chunk_ratio + 1)
    bat[chunk_ratio] = SB_PRESENT | (sb_at // MIB) << 20
    order = list(range(blocks - 1))
    rnd.shuffle(order)
    full, part = order[0], order[1]  # part and part + 1 are partially present
    rest = [b for b in order[2:] if b not in (part + 1, full)]
    zero, unmapped, undefined = rest[0], rest[1], rest[2]

    def allocate(b):
        at = len(out)
        out.extend(bytes(block))
        return at

    at = allocate(full)
    data = os.urandom(block)
    out[at:at + block] = data
    guest[full * block:(full + 1) * block] = data
    bat[full] = FULLY | (at // MIB) << 20

    # Sector runs in blocks part and part + 1, one crossing between them.
    runs = [(part * per_block + rnd.randrange(0, per_block // 2), rnd.randrange(1, 40)) for _ in range(3)]
    runs.append(((part + 1) * per_block - 3, 7))
    runs.append(((part + 1) * per_block + rnd.randrange(per_block // 2, per_block - 40), rnd.randrange(1, 40)))
    where = {part: allocate(part), part + 1: allocate(part + 1)}
    for b in where:
        bat[b] = PARTIALLY | (where[b] // MIB) << 20
    for first, n in runs:
        for s in range(first, first + n):
            d = os.urandom(sector)
            b, k = divmod(s, per_block)
            out[where[b] + k * sector:where[b] + (k + 1) * sector] = d
            guest[s * sector:(s + 1) * sector] = d
            out[sb_at + s // 8] |= 1 << (s % 8)  # the bitmap covers the chunk from sector 0
    for b, state in ((zero, ZERO), (unmapped, UNMAPPED)):
        bat[b] = state
        guest[b * block:(b + 1) * block] = bytes(block)
    bat[undefined] = UNDEFINED
    for i, e in enumerate(bat):
        struct.pack_into("<Q", out, bat_at + 8 * i, e)

    out[:8] = b"vhdxfile"
    creator = "make-vhdx-child.py".encode("utf-16-le")
    out[8:8 + len(creator)] = creator

    log_guid = uuid.uuid4().bytes_le if dirty else bytes(16)
    h = bytearray(4 * KIB)
    h[:4] = b"head"
    struct.pack_into("<Q", h, 8, 10)
    h[16:32] = uuid.uuid4().bytes_le  # FileWriteGuid
    h[32:48] = uuid.uuid4().bytes_le  # DataWriteGuid: what a child of this file names
    h[48:64] = log_guid
    struct.pack_into("<HHIQ", h, 64, 0, 1, MIB, log_at)
    seal(h)
    out[64 * KIB:68 * KIB] = h
    torn = bytearray(h)  # a newer header whose write was torn: bad CRC, other guids
    struct.pack_into("<Q", torn, 8, 11)
    torn[32:48] = uuid.uuid4().bytes_le
    torn[48:64] = uuid.uuid4().bytes_le
    out[128 * KIB:132 * KIB] = torn
    if dirty:
        entry = bytearray(4 * KIB)
        entry[:4] = b"loge"
        struct.pack_into("<IIQII", entry, 8, 4 * KIB, 0, 1, 0, 0)
        entry[32:48] = log_guid
        struct.pack_into("<QQ", entry, 48, len(out), len(out))
        seal(entry)
        out[log_at:log_at + 4 * KIB] = entry

    rt = bytearray(64 * KIB)
    rt[:4] = b"regi"
    struct.pack_into("<I", rt, 8, 2)
    rt[16:32] = BAT_REGION.bytes_le
    struct.pack_into("<QII", rt, 32, bat_at, MIB, 1)
    rt[48:64] = METADATA_REGION.bytes_le
    struct.pack_into("<QII", rt, 64, meta_at, MIB, 1)
    seal(rt)
    out[192 * KIB:256 * KIB] = rt
    out[256 * KIB:320 * KIB] = rt

    name = os.path.basename(parent)
    kv = [("parent_linkage", "{%s}" % pguid), ("relative_path", ".\\" + name), ("absolute_win32_path", "C:\\PVS\\" + name)]
    loc = bytearray(20 + 12 * len(kv))
    loc[:16] = LOCATOR_TYPE.bytes_le
    struct.pack_into("<HH", loc, 16, 0, len(kv))
    for i, (k, v) in enumerate(kv):
        kb, vb = k.encode("utf-16-le"), v.encode("utf-16-le")
        struct.pack_into("<IIHH", loc, 20 + 12 * i, len(loc), len(loc) + len(kb), len(kb), len(vb))
        loc += kb + vb
    items = [
        (FILE_PARAMETERS, 4, struct.pack("<II", block, 2)),  # HasParent
        (VIRTUAL_DISK_SIZE, 6, struct.pack("<Q", size)),
        (VIRTUAL_DISK_ID, 6, uuid.uuid4().bytes_le),
        (LOGICAL_SECTOR_SIZE, 6, struct.pack("<I", sector)),
        (PHYSICAL_SECTOR_SIZE, 6, struct.pack("<I", 4096)),
        (PARENT_LOCATOR, 6, bytes(loc)),
    ]
    out[meta_at:meta_at + 8] = b"metadata"
    struct.pack_into("<H", out, meta_at + 10, len(items))
    off = 64 * KIB
    for i, (guid, flags, data) in enumerate(items):
        e = meta_at + 32 + 32 * i
        out[e:e + 16] = guid.bytes_le
        struct.pack_into("<III", out, e + 16, off, len(data), flags)
        out[meta_at + off:meta_at + off + len(data)] = data
        off += -(-len(data) // 8) * 8
    open(child, "wb").write(out)
    open(child_raw, "wb").write(guest)


main()
