#!/usr/bin/env bash
# An attach of a `server`-type target is fenced: its name (target/ID@ATTACH), which the
# export's description, the agent's status and the API publish, is no credential. While
# the agent holds the attach, nbdsh naming it (alone, or with a wrong secret) is refused,
# cannot write, and the server logs the refusal with the client; NBD_OPT_INFO on the name
# gets the same refusal (no size, no flags). After the server is SIGKILLed and restarted
# under a server-persistent target, the agent reconnects with the secret it was handed at
# attach and reads its own writes, and the name alone is still refused. The secret shows
# up in no status, log, API answer or metric. Last, a target attached anew (under a new
# name) while its agent was away leaves that agent EIO, not a wait.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
require nbdsh nbdinfo curl qemu-io
require_python_nbd
require_vdstream
is_vdstream || skip "target/ID is vdstream's"
e2e_init
store_init

golden_vdisk w 16
vds target add s1 --vdisk w --cache server >/dev/null
vds target add p1 --vdisk w --cache server-persistent >/dev/null
start_store_server --http 127.0.0.1:0
srv=$SOCK
api_url() { grep -Eo 'http://127\.0\.0\.1:[0-9]+' "$SERVER_LOG" | tail -n1; }

# The agents write a pattern each.
start_agent s1 --server "$(xuri target/s1 "$srv")" --cache server
uri_s1=$URI pid_s1=$AGENT_PID
start_agent p1 --server "$(xuri target/p1 "$srv")" --cache server-persistent
uri_p1=$URI pid_p1=$AGENT_PID
for t in s1 p1; do
    v=uri_$t
    URI=${!v} nbdsh_script '
h.pwrite(b"\x5a" * 65536, 1 << 20)
flush_if_offered()
' || fail "the $t agent's guest could not write"
done

# The published attach names: first word of the description in the agent's status.
attach_name() { agent_status_get "$1" 'j["vdisk"]["description"].split()[0]'; }
name_s1=$(attach_name s1) name_p1=$(attach_name p1)
[[ $name_s1 == target/s1@* && $name_p1 == target/p1@* && $name_s1 != *"#"* ]] || fail "published attach names: $name_s1 $name_p1"
log "published attach names: $name_s1, $name_p1"

# hijack NAME SOCK — nbdsh connects to NAME and writes 0xEE over the guest's pattern;
# prints "admitted" or "refused: WHY" (libnbd's words, then the server's message of the
# refusal, which libnbd does not show, read with a raw NBD_OPT_GO).
hijack() {
    hijack_nbdsh "$@"
    refusal "$1" "$2"
}
hijack_nbdsh() {
    HIJACK_NAME=$1 HIJACK_SOCK=$2 timeout 30 nbdsh -c '
import os, sys
h.set_export_name(os.environ["HIJACK_NAME"])
try:
    h.connect_unix(os.environ["HIJACK_SOCK"])
except nbd.Error as e:
    print("refused:", e)
    sys.exit(0)
h.pwrite(b"\xee" * 4096, 1 << 20)
if h.can_flush():
    h.flush()
print("admitted")
' 2>&1 || true
}

# --- while the agents hold their attaches: the name alone, and a wrong secret, are refused
for name in "$name_s1" "$name_p1" "$name_s1#0123456789abcdef0123456789abcdef"; do
    r=$(hijack "$name" "$srv")
    [[ $r == refused:* && $r == *"is fenced"* ]] || fail "nbdsh with $name while the agent holds it: $r"
    log "ok: $name refused while held: $r"
done
# NBD_OPT_INFO (nbdsh in option mode) on the published name gets the refusal GO gets: no
# size, no flags.
for name in "$name_s1" "$name_p1"; do
    r=$(HIJACK_NAME=$name HIJACK_SOCK=$srv timeout 30 nbdsh -c '
import os
h.set_opt_mode(True)
h.connect_unix(os.environ["HIJACK_SOCK"])
h.set_export_name(os.environ["HIJACK_NAME"])
try:
    h.opt_info()
    print("answered: size", h.get_size())
except nbd.Error as e:
    print("refused:", e)
h.opt_abort()
' 2>&1 || true)
    [[ $r == refused:* ]] || fail "NBD_OPT_INFO on $name while the agent holds it: $r"
    log "ok: NBD_OPT_INFO on $name refused: $r"
done
grep -q "open refused (policy): client .*\"$name_s1\" (NBD_OPT_INFO): .*is fenced" "$SERVER_LOG" \
    || fail "the server did not log the refused INFO: $(grep -i 'NBD_OPT_INFO' "$SERVER_LOG" | tail -n 3)"
grep -q "target s1: refused a connection from .* to $name_s1: it presented no secret" "$SERVER_LOG" \
    || fail "the server did not log the refusal of $name_s1: $(grep -i refused "$SERVER_LOG")"
grep -q "target s1: refused a connection from .* to $name_s1: it presented a wrong secret" "$SERVER_LOG" \
    || fail "the server did not log the refusal of a wrong secret: $(grep -i refused "$SERVER_LOG")"
for t in s1 p1; do
    v=uri_$t
    URI=${!v} nbdsh_script '
assert h.pread(65536, 1 << 20) == b"\x5a" * 65536, "a hijacker wrote into the disk"
' || fail "the $t guest does not read back its own data"
done
log "ok: the guests read their own data; nothing was written by the refused clients"

# --- the agent's connection cut: SIGKILL and restart the server
kill -KILL "$SERVER_PID"
wait "$SERVER_PID" 2>/dev/null || true
start_store_server_on "$srv" --http 127.0.0.1:0
r=$(hijack "$name_p1" "$srv")
[[ $r == refused:* && $r == *"is fenced"* ]] || fail "nbdsh with $name_p1 after the server restart: $r"
log "ok: $name_p1 alone refused after the restart: $r"
URI=$uri_p1 nbdsh_script '
assert h.pread(65536, 1 << 20) == b"\x5a" * 65536, "p1 lost its data"
h.pwrite(b"\x77" * 4096, 2 << 20)
flush_if_offered()
assert h.pread(4096, 2 << 20) == b"\x77" * 4096
' || fail "the p1 agent did not come back with its data after the restart"
sleep 1.5   # the status file is rewritten every second
reconnects=$(agent_status_get p1 'j["server"]["reconnects"]')
((reconnects >= 1)) || fail "the p1 agent did not reconnect"
assert_eq "p1 agent state" "$(agent_status_get p1 'j["state"]')" running
r=$(hijack "$name_p1" "$srv")
[[ $r == refused:* && $r == *"is fenced"* ]] || fail "nbdsh with $name_p1 after the agent reconnected: $r"
log "ok: the agent reconnected with its secret ($reconnects reconnects); the name alone is still refused"

# --- the secret is published nowhere
API=$(api_url)
curl -sS --max-time 10 "$API/api/v1/sessions" >"$E2E_TMP/sessions.json" || fail "GET /api/v1/sessions failed"
curl -sS --max-time 10 "$API/metrics" >"$E2E_TMP/metrics.txt" || fail "GET /metrics failed"
grep -q "target/p1" "$E2E_TMP/sessions.json" || fail "the API does not show p1's session: $(cat "$E2E_TMP/sessions.json")"
"$VDSTREAM_BIN" target status p1 --json >"$E2E_TMP/p1.json"
# s1's server cache died with the killed server: its agent learnt so when it reconnected,
# at once (it replaces a closed connection without waiting for a request), and its status
# says so with exit status 6.
rc=0
"$VDSTREAM_BIN" target status s1 --json >"$E2E_TMP/s1.json" || rc=$?
assert_eq "target status s1 (its cache lost: exit status, state)" "$rc $(json_get "$E2E_TMP/s1.json" 'j["state"]')" "6 cache lost"
for f in "$E2E_TMP/sessions.json" "$E2E_TMP/metrics.txt" "$E2E_TMP"/server*.log "$E2E_TMP"/agent-*.log "$E2E_TMP/p1.json" "$E2E_TMP/s1.json"; do
    if grep -Eq "target/(s1|p1)@[a-z0-9]+(\+journal)?#" "$f"; then
        fail "$f shows an attach secret: $(grep -Eo "target/(s1|p1)@[a-z0-9]+(\+journal)?#[0-9a-f]*" "$f" | head -n 3)"
    fi
done
perm=$(stat -c %a "$STORE"/cache/*.vdattach)
assert_eq "mode of the server-persistent attach file" "$perm" 600
log "ok: no status, log, API answer or metric shows a secret"

# --- attached anew while the agent was away: its attach is gone, EIO, not a wait.
# The p1 agent is stopped (SIGSTOP) and the server killed and restarted: a new attach of
# p1 (nbdsh on target/p1) continues the cache on disk under a new name. The old agent,
# woken, is refused as gone and fails its guest's requests with EIO.
kill -STOP "$pid_p1"
kill -KILL "$SERVER_PID"
wait "$SERVER_PID" 2>/dev/null || true
start_store_server_on "$srv"
URI=$(xuri target/p1 "$srv") nbdsh_script '
assert h.pread(4096, 2 << 20) == b"\x77" * 4096, "the new attach does not continue the cache"
assert h.get_export_name() == "target/p1"
' || fail "a new attach of p1 after the restart"
grep -q "target p1: new attach [a-z0-9]* continues its server-persistent cache (was attach ${name_p1#target/p1@}" "$SERVER_LOG" \
    || fail "the new attach of p1 did not take a new name: $(grep 'target p1' "$SERVER_LOG")"
kill -CONT "$pid_p1"
out=$(timeout 60 nbdsh -u "$uri_p1" -c '
import errno
try:
    h.pread(4096, 0)
    print("read-ok")
except nbd.Error as e:
    print("read-error", e.errno if isinstance(e.errno, str) else errno.errorcode[e.errno])
' 2>&1) || true
[[ $out == "read-error EIO" ]] || fail "the old p1 agent after its target was attached anew: $out"
grep -q "target p1: refused the reconnect of attach ${name_p1#target/p1@} from .*: its server-persistent cache now belongs to another attach" "$SERVER_LOG" \
    || fail "the server did not log the old attach's refusal: $(grep 'target p1' "$SERVER_LOG")"
sleep 1.5
assert_eq "the old p1 agent's state" "$(agent_status_get p1 'j["state"]')" "cache lost"
log "ok: a target attached anew while its agent was away: the old agent gets EIO, not a wait"

for p in "$pid_s1" "$pid_p1"; do stop_server "$p" 15 || true; done
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
log "ok: attaches are fenced"
