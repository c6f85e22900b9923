#!/usr/bin/env bash
# Trim on a --memory disk: trimmed space reads back as zero (the memory disk guarantees
# it), bytes around the trimmed range are untouched, including for an unaligned trim.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh
require_python_nbd
e2e_init

start_server --memory 64M
nbdsh_script "
import os
MiB = 1 << 20
assert h.can_trim(), 'can_trim false'
pattern = os.urandom(4 * MiB)
h.pwrite(pattern, 0)
h.trim(2 * MiB, MiB)
h.trim(123, 1000)                    # (count, offset) unaligned: may be ignored, must not touch neighbours
flush_if_offered()
buf = h.pread(4 * MiB, 0)
assert buf[MiB:3 * MiB] == bytes(2 * MiB), 'trimmed range does not read as zero'
assert buf[:1000] == pattern[:1000] and buf[1123:MiB] == pattern[1123:MiB], 'bytes around unaligned trim changed'
assert buf[3 * MiB:] == pattern[3 * MiB:], 'bytes after trimmed range changed'
assert buf[1000:1123] in (pattern[1000:1123], bytes(123)), 'unaligned trim left garbage'
"
