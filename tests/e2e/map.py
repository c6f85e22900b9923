# map.py — helper for the --map tests: compare `nbdinfo --map --json` output with the
# byte ranges that hold data. Usage: map.py MAP_JSON SIZE START:LEN [START:LEN...]
# Every written range must be reported as data (type 0), everything else as a hole
# (bit 0 set). Exits 1 with a description of the first mismatch.
import json
import sys

extents = json.load(open(sys.argv[1]))
size = int(sys.argv[2])
written = sorted(tuple(int(x) for x in r.split(":")) for r in sys.argv[3:])

pos = 0
for e in extents:
    if e["offset"] != pos:
        sys.exit(f"map: extent at {e['offset']} does not follow previous end {pos}")
    pos += e["length"]
if pos != size:
    sys.exit(f"map: extents cover {pos} bytes, export has {size}")


def want_data(off):
    return any(s <= off < s + n for s, n in written)


def is_data(e):
    return (e["type"] & 1) == 0


# Check at every boundary of both lists, so the comparison is exact without walking bytes.
points = {0}
for s, n in written:
    points.update((s, s + n))
for e in extents:
    points.add(e["offset"])
points = sorted(p for p in points if p < size)
for p in points:
    e = next(e for e in extents if e["offset"] <= p < e["offset"] + e["length"])
    if is_data(e) != want_data(p):
        kind = "data" if want_data(p) else "a hole"
        sys.exit(f"map: offset {p} should be {kind}, server says {e}")
data = sum(e["length"] for e in extents if is_data(e))
print(f"map ok: {len(extents)} extents, {data} bytes of data")
