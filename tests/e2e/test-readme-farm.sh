#!/usr/bin/env bash
# README's "A farm on one host", run as written: the ```sh block under that heading is
# taken from README.md and run line by line in one shell, with `vdstream` on PATH (a
# symlink to $VDSTREAM_BIN, as the package installs it), HOME in the scratch folder (the
# block's ~/farm) and the port of its first line, `HTTP=127.0.0.1:PORT`, replaced by a free
# one. A line that ends in `&` starts a service in the background: the test waits (bounded)
# for the socket its --socket names and for the API its --http names before the next line,
# as a user would before typing on. Everything listens on unix sockets or 127.0.0.1.
# Then what a user would check:
# - nbdinfo (the block's own) shows the target's disk, the size of the imported image;
# - the block's write through the target lands in the target's cache (its agent's status:
#   RAM used, nothing written to the server) and reads back through the target, while the
#   vDisk served by the server still equals the imported image (qemu-img compare) and the
#   server wrote nothing to the store;
# - the server's start output names the console's URL; the URL the block names answers
#   with the page, and the API lists the target's session;
# - the agent and then the server stop cleanly on SIGTERM (the README's `kill %2 %1`).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require_vdstream
require nbdinfo qemu-img qemu-io curl
[[ -x $PY ]] || skip "$PY not found"
e2e_init

README=$REPO_ROOT/README.md
FARM_SECS=${VDSTREAM_E2E_READY_SECS:-30}

# The block, its commands as the README shows them.
"$PY" - "$README" >"$E2E_TMP/block.sh" <<'PY' || fail "README.md has no \`\`\`sh block under '## A farm on one host'"
import sys
lines = open(sys.argv[1]).read().split("\n")
start = lines.index("## A farm on one host")
i = start + 1
while not lines[i].startswith("```sh"):
    if lines[i].startswith("## "):
        sys.exit(1)
    i += 1
j = i + 1
while not lines[j].startswith("```"):
    j += 1
print("\n".join(lines[i + 1:j]))
PY
log "the README's farm block ($(wc -l <"$E2E_TMP/block.sh") lines):"
cat "$E2E_TMP/block.sh" >&2

first=$(head -n1 "$E2E_TMP/block.sh")
[[ $first =~ ^HTTP=127\.0\.0\.1:([0-9]+)[[:space:]] ]] ||
    fail "the block's first line is '$first': this test sets the API's port through a first line HTTP=127.0.0.1:PORT"
readme_port=${BASH_REMATCH[1]}
! grep -q 'cargo' "$E2E_TMP/block.sh" || fail "the block runs cargo: it should use the installed vdstream"
console_url=$(grep -Eo 'http://127\.0\.0\.1:[0-9]+/console' "$E2E_TMP/block.sh" | head -n1)
[[ -n $console_url ]] || fail "the block names no console URL (http://127.0.0.1:PORT/console)"

port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
api=127.0.0.1:$port
console_url=${console_url/127.0.0.1:$readme_port/$api}
log "the API on $api instead of 127.0.0.1:$readme_port"

# The script the block becomes: each line as written; after a background line, its pid
# is kept and the service waited for.
"$PY" - "$E2E_TMP/block.sh" "$port" "$E2E_TMP/pids" "$FARM_SECS" >"$E2E_TMP/farm.sh" <<'PY'
import re, shlex, sys
block, port, pidfile, secs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
lines = open(block).read().split("\n")
# Join continuation lines.
cmds, cur = [], ""
for line in lines:
    if line.endswith("\\"):
        cur += line[:-1] + " "
        continue
    cmds.append(cur + line)
    cur = ""
out = [
    "set -e -o pipefail",
    f"readme_ready() {{  # PID ARGS...: wait up to {secs} s for the service that ARGS start",
    "    local pid=$1 sock= http= deadline=$((SECONDS + " + secs + "))",
    "    shift",
    "    while (($#)); do",
    "        case $1 in --socket) sock=$2; shift ;; --http) http=$2; shift ;; esac",
    "        shift",
    "    done",
    "    while ((SECONDS < deadline)); do",
    "        if ! kill -0 \"$pid\" 2>/dev/null; then",
    "            echo \"readme-farm: pid $pid exited before it was ready\" >&2",
    "            return 1",
    "        fi",
    "        if [[ -n $sock && ! -S $sock ]]; then sleep 0.1; continue; fi",
    "        if [[ -z $http ]] || curl -sf --max-time 2 \"http://$http/api/v1/server\" >/dev/null; then",
    "            return 0",
    "        fi",
    "        sleep 0.1",
    "    done",
    f"    echo \"readme-farm: not ready within {secs} s: socket '$sock', API '$http'\" >&2",
    "    return 1",
    "}",
]
bg = re.compile(r"^(.*[^&])&\s*(#.*)?$")
for n, cmd in enumerate(cmds):
    if n == 0:
        cmd = re.sub(r"^HTTP=127\.0\.0\.1:[0-9]+", "HTTP=127.0.0.1:" + port, cmd)
    if cmd.strip() and not cmd.strip().startswith("#"):
        out.append("printf 'readme-farm: + %s\\n' " + shlex.quote(cmd.strip()) + " >&2")
    out.append(cmd)
    m = bg.match(cmd)
    if m:
        words = m.group(1).strip().split(None, 1)
        out.append(f"echo $! >>{pidfile}")
        out.append("readme_ready $! " + (words[1] if len(words) > 1 else ""))
print("\n".join(out))
PY

# The user's machine: the installed command, a home with nothing in it, no credentials or
# store settings of the runner's.
mkdir -p "$E2E_TMP/bin" "$E2E_TMP/home" "$E2E_TMP/run" "$E2E_TMP/cache"
ln -s "$VDSTREAM_BIN" "$E2E_TMP/bin/vdstream"
: >"$E2E_TMP/pids"
stop_farm() {
    local pids=() i
    mapfile -t pids <"$E2E_TMP/pids" 2>/dev/null || return 0
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        stop_pid "${pids[i]}" 10
    done
}
E2E_CLEANUP_HOOKS+=(stop_farm)
E2E_SERVER_LOGS+=("$E2E_TMP/farm.log") # the block's output, shown (its last lines) on failure

rc=0
(
    cd "$E2E_TMP/home"
    unset VDSTREAM_STORE VDSTREAM_TOKEN VDSTREAM_TOKEN_FILE VDSTREAM_TLS_CERTIFICATES VDSTREAM_CA XDG_RUNTIME_DIR
    export HOME=$E2E_TMP/home PATH=$E2E_TMP/bin:$PATH
    export VDSTREAM_RUN_DIR=$E2E_TMP/run VDSTREAM_CACHE_DIR=$E2E_TMP/cache
    exec timeout --kill-after=5 120 bash "$E2E_TMP/farm.sh"
) >"$E2E_TMP/farm.log" 2>&1 </dev/null || rc=$?
mapfile -t pids <"$E2E_TMP/pids"
if ((rc != 0)); then
    ((rc == 124 || rc == 137)) && fail "the README's farm block did not finish within 120 s"
    fail "the README's farm block failed (status $rc): the last command above did not work as written"
fi
# What the server and the agent print is for people: no Rust debug forms.
if grep -aEn '[A-Z][A-Za-z]+ \{ [a-z_]+: |Some\(' "$E2E_TMP/farm.log"; then
    fail "the farm's output (above) prints Rust debug structs"
fi
grep -qF "vdstream: console on $console_url" "$E2E_TMP/farm.log" ||
    fail "the server's start output does not name the console's URL ($console_url)"
log "ok: the server's start output names the console: $console_url"
((${#pids[@]} == 2)) || fail "the block started ${#pids[@]} background services, want 2 (the server, the agent)"
server_pid=${pids[0]} agent_pid=${pids[1]}
log "ok: the block ran as written (server pid $server_pid, agent pid $agent_pid)"

farm=$E2E_TMP/home/farm
export VDSTREAM_STORE=$farm/store VDSTREAM_RUN_DIR=$E2E_TMP/run VDSTREAM_CACHE_DIR=$E2E_TMP/cache
agent_uri="nbd+unix:///?socket=$farm/vm1.sock"
vdisk_uri="nbd+unix:///vdisk/golden?socket=$farm/server.sock"

# nbdinfo shows the target's disk: the imported image's size.
want_size=$(qemu-img info --output=json "$farm/golden.qcow2" | json_get /dev/stdin 'j["virtual-size"]')
grep -Eq "^[[:space:]]*export-size: $want_size( |$)" "$E2E_TMP/farm.log" ||
    fail "the block's nbdinfo did not show a disk of $want_size bytes: $(grep -A3 'export=' "$E2E_TMP/farm.log")"
assert_eq "the target's disk size" "$(timeout 10 nbdinfo --size "$agent_uri")" "$want_size"

# The write landed in the target's cache, and not in the vDisk.
ok=
for ((i = 0; i < 50; i++)); do
    "$VDSTREAM_BIN" target status vm1 --json >"$E2E_TMP/status.json" 2>/dev/null || true
    if [[ -s $E2E_TMP/status.json ]] &&
        [[ $(json_get "$E2E_TMP/status.json" \
            'j["cache"]["ram_bytes"] >= 1 << 20 and j["guest"]["write_bytes"] >= 1 << 20') == True ]]; then
        ok=1
        break
    fi
    sleep 0.2
done
[[ -n $ok ]] || fail "the agent's status does not show the 1 MiB write in its cache: $(cat "$E2E_TMP/status.json")"
assert_eq "the agent's cache type" "$(json_get "$E2E_TMP/status.json" 'j["cache"]["type"]')" ram-overflow
assert_eq "bytes the agent wrote to the server" "$(json_get "$E2E_TMP/status.json" 'j["server"]["write_bytes"]')" 0
timeout 30 qemu-io -r -f raw -c 'read -P 0x5a 0 1M' "$agent_uri" >"$E2E_TMP/readback.out" 2>&1 ||
    fail "the target does not read back its write: $(cat "$E2E_TMP/readback.out")"
log "ok: the target reads back its write, which sits in its RAM cache"
timeout 60 qemu-img compare -f qcow2 -F raw "$farm/golden.qcow2" "$vdisk_uri" >"$E2E_TMP/compare.out" 2>&1 ||
    fail "the vDisk the server serves differs from the imported image: $(cat "$E2E_TMP/compare.out")"
curl -sf --max-time 10 "http://$api/api/v1/server" >"$E2E_TMP/server.json" || fail "GET /api/v1/server failed"
assert_eq "bytes the server wrote to the store" "$(json_get "$E2E_TMP/server.json" 'j["io"]["store"]["write_bytes"]')" 0
log "ok: the vDisk equals the imported image"

# The console answers where the block says, and the API shows the target's session.
curl -s --max-time 10 -o "$E2E_TMP/console.html" -w '%{http_code} %{content_type}' "$console_url" \
    >"$E2E_TMP/console.status" || fail "$console_url does not answer"
read -r code ctype <"$E2E_TMP/console.status" || true  # curl writes no newline
assert_eq "the console's status" "$code" 200
[[ $ctype == text/html* ]] || fail "$console_url answered $ctype, not a page"
grep -qi 'vdstream' "$E2E_TMP/console.html" ||
    fail "$console_url is not the console: $(head -c 300 "$E2E_TMP/console.html")"
curl -sf --max-time 10 "http://$api/api/v1/sessions" >"$E2E_TMP/sessions.json" || fail "GET /api/v1/sessions failed"
grep -q 'target/vm1' "$E2E_TMP/sessions.json" ||
    fail "the API lists no session of target vm1: $(cat "$E2E_TMP/sessions.json")"
log "ok: the console answers at $console_url; the API lists vm1's session"

# `kill %2 %1`: the agent, then the server, each draining and exiting by itself. (They are
# children of the block's shell, which has exited, so their exit status cannot be had:
# what they leave behind is checked.)
# term_and_wait PID WHAT — SIGTERM, then wait up to 15 s for PID to exit by itself.
term_and_wait() {
    local pid=$1 what=$2 i
    kill -TERM "$pid" 2>/dev/null || fail "$what (pid $pid) was no longer running"
    for ((i = 0; i < 150; i++)); do
        kill -0 "$pid" 2>/dev/null || { log "ok: $what exited on SIGTERM"; return 0; }
        sleep 0.1
    done
    fail "$what did not exit within 15 s of SIGTERM"
}
# What a new administrator tried: removing the target from the store while its agent runs
# here. Refused (exit 4, the record kept) and told to stop the agent or use --force.
rc=0
"$VDSTREAM_BIN" target remove vm1 >"$E2E_TMP/remove.out" 2>&1 || rc=$?
assert_eq "target remove while its agent runs (exit status)" "$rc" 4
grep -q "its agent (pid $agent_pid) runs on this host" "$E2E_TMP/remove.out" ||
    fail "the refusal does not name the running agent: $(cat "$E2E_TMP/remove.out")"
grep -q -- "--force" "$E2E_TMP/remove.out" || fail "the refusal does not name --force: $(cat "$E2E_TMP/remove.out")"
"$VDSTREAM_BIN" target show vm1 >/dev/null || fail "target remove refused, but the record is gone"
log "ok: target remove refuses while the agent runs on this host"
term_and_wait "$agent_pid" "the agent"
[[ ! -e $farm/vm1.sock ]] || fail "the agent left its socket $farm/vm1.sock"
rc=0
"$VDSTREAM_BIN" target status vm1 --json >"$E2E_TMP/last.json" 2>/dev/null || rc=$?
assert_eq "target status of the stopped agent (exit status)" "$rc" 6
assert_eq "the agent's last state" "$(json_get "$E2E_TMP/last.json" 'j["state"]')" stopped
"$VDSTREAM_BIN" target remove vm1 >/dev/null || fail "target remove of a stopped agent's target failed"
log "ok: once the agent stopped, target remove removes vm1"
term_and_wait "$server_pid" "the server"
log "ok: README's farm on one host runs as written"
