#!/usr/bin/env bash
# RAM is taken as data is written and given back to the system on TRIM: for the RAM disk
# (--memory) and the RAM write caches (device-ram, ram-overflow), the server's resident
# size grows by about what was written and falls back near its start within seconds of a
# trim of the whole disk, also when a ram-overflow cache has overflowed. Checked through
# /proc/PID/status (VmRSS), as an administrator would.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh
require_python_nbd
require_vdstream
e2e_init

rss_mib() { awk '/^VmRSS/ {printf "%d", $2 / 1024}' "/proc/$SERVER_PID/status"; }

check_gives_back() {
    local label=$1 before after_write after_trim
    before=$(rss_mib)
    nbdsh_script "
import os
chunk = os.urandom(1 << 20)
for i in range(192):                      # 192 MiB of data at scattered 1 MiB offsets
    h.pwrite(chunk, ((i * 37) % 512) << 20)
"
    after_write=$(rss_mib)
    nbdsh_script "h.trim(h.get_size(), 0)"
    # Within a few seconds: a ram-overflow cache keeps the page buffers its evictions freed
    # for reuse until its flusher has had a quiet second.
    for _ in $(seq 1 16); do
        sleep 0.25
        after_trim=$(rss_mib)
        ((after_trim <= before + 24)) && break
    done
    log "$label: RSS ${before} MiB at start, ${after_write} MiB after writing, ${after_trim} MiB after trim"
    ((after_write >= before + 120)) || fail "$label: RSS grew only from $before to $after_write MiB for ~150+ MiB written"
    ((after_trim <= before + 24)) || fail "$label: RSS still $after_trim MiB after trimming everything (started at $before MiB)"
}

start_server --memory 1G
check_gives_back "--memory 1G"
stop_server

truncate -s 1G "$E2E_TMP/base.img"
start_server "$E2E_TMP/base.img" --cache device-ram --ram 1G
check_gives_back "--cache device-ram"
stop_server

start_server "$E2E_TMP/base.img" --cache ram-overflow --ram 1G --overflow-dir "$E2E_TMP"
check_gives_back "--cache ram-overflow"
stop_server

# Overflowing: 192 MiB through 128 MiB of RAM, so evictions run and fill the spare pool.
start_server "$E2E_TMP/base.img" --cache ram-overflow --ram 128M --overflow-dir "$E2E_TMP"
check_gives_back "--cache ram-overflow --ram 128M (overflowing)"
stop_server
