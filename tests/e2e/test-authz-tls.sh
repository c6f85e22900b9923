#!/usr/bin/env bash
# Authorization with real TLS clients: `vdstream server --tls require` on a unix socket,
# certificates made with openssl whose SAN URI names the role (urn:vdstream:target:A, ...).
# nbdinfo with target A's certificate opens target/A and its record's vDisk, and is
# refused target/B and maintenance/w with NBD_REP_ERR_POLICY and the rule's name; each
# refusal is a line in the store's audit trail; `nbdinfo --list` shows A only its vDisk;
# an administrator's certificate opens another target's export; a client without a
# certificate is anonymous and gets nothing (--anonymous none), then read-only vDisks
# (--anonymous vdisks).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
require nbdinfo
require_vdstream
e2e_init
# shellcheck source=tls-lib.sh
source "$E2E_DIR/tls-lib.sh"
store_init

pki=$E2E_TMP/pki
make_ca "$pki/ca"
issue "$pki/ca" "$pki/server" server "DNS:localhost,IP:127.0.0.1"
issue "$pki/ca" "$pki/A" client "URI:urn:vdstream:target:A"
issue "$pki/ca" "$pki/B" client "URI:urn:vdstream:target:B"
issue "$pki/ca" "$pki/admin" client "URI:urn:vdstream:admin:alice"
mkdir -p "$pki/anon" && cp "$pki/ca/ca-cert.pem" "$pki/anon/"   # trusts the server, shows no certificate

vds vdisk create w --size 1M >/dev/null
vds vdisk create lin --size 1M >/dev/null
vds target add A --vdisk w --cache device-disk >/dev/null
vds target add B --vdisk lin --cache device-disk >/dev/null

# serve ANONYMOUS — a server with --tls require on a fresh socket ($SOCK, $SERVER_PID, $SERVER_LOG).
serve() {
    local n=${#E2E_SERVER_PIDS[@]} i
    SOCK=$E2E_TMP/server$n.sock
    SERVER_LOG=$E2E_TMP/server$n.log
    RUST_LOG=info "$VDSTREAM_BIN" server --store "$STORE" --socket "$SOCK" --tls require \
        --tls-certificates "$pki/server" --anonymous "$1" >"$SERVER_LOG" 2>&1 </dev/null &
    SERVER_PID=$!
    E2E_PIDS+=("$SERVER_PID")
    E2E_SERVER_PIDS+=("$SERVER_PID")
    E2E_SERVER_LOGS+=("$SERVER_LOG")
    for ((i = 0; i < 200; i++)); do
        [[ -S $SOCK ]] && timeout 5 nbdinfo --size "$(uri admin vdisk/w)" >/dev/null 2>&1 && return 0
        server_alive "$SERVER_PID" || fail "the server exited: $(cat "$SERVER_LOG")"
        sleep 0.1
    done
    fail "the server did not accept an administrator's TLS connection on $SOCK"
}

# uri WHO EXPORT — the nbds+unix URI of EXPORT with WHO's certificate directory.
uri() { printf 'nbds+unix:///%s?socket=%s&tls-certificates=%s' "$2" "$SOCK" "$pki/$1"; }

# opens WHO EXPORT — nbdinfo as WHO opens EXPORT.
opens() {
    local out
    out=$(run_bounded 20 nbdinfo --size "$(uri "$1" "$2")" 2>&1) || fail "$1 could not open $2: $out"
    log "ok: $1 opens $2"
}

# refused WHO EXPORT RULE — nbdinfo as WHO is refused EXPORT with NBD_REP_ERR_POLICY (libnbd:
# "server policy prevents") and the server's message naming RULE (libnbd shows it in its
# debug output).
refused() {
    local out rc=0
    out=$(LIBNBD_DEBUG=1 run_bounded 20 nbdinfo --size "$(uri "$1" "$2")" 2>&1) || rc=$?
    ((rc != 0)) || fail "$1 opened $2: $out"
    grep -q "server policy prevents" <<<"$out" || fail "$1 opening $2: not NBD_REP_ERR_POLICY: $(grep -v 'debug: .*: \(recv\|send\)' <<<"$out" | tail -5)"
    grep -qF "server error message: refused by policy: rule $3:" <<<"$out" \
        || fail "$1 opening $2: the server's message does not name rule $3: $(grep 'error message' <<<"$out")"
    log "ok: $1 refused $2 (rule $3)"
}

# refusals — the audit trail's refused opens, one "identity export rule" a line.
refusals() {
    "$PY" -c '
import json, sys
for line in open(sys.argv[1]):
    e = json.loads(line)
    if e["action"] == "nbd.open.refused":
        d = e["details"]
        print(d["identity"], d["export"], d["rule"])' "$STORE/audit.log"
}

serve none
opens A target/A
opens A vdisk/w
opens A vdisk/w@base
refused A target/B target-own-exports
refused A maintenance/w maintenance-needs-admin
refused A vdisk/lin target-own-exports
refused B target/A target-own-exports
opens admin target/B
refused anon vdisk/w anonymous-none

want="target:A target/B target-own-exports
target:A maintenance/w maintenance-needs-admin
target:A vdisk/lin target-own-exports
target:B target/A target-own-exports
anonymous vdisk/w anonymous-none"
got=$(refusals)
[[ $got == "$want" ]] || fail "the audit trail's refusals are:
$got
want:
$want"
log "ok: each refusal is a line in the audit trail (identity, export, rule)"
grep -q "open refused (policy).*rule target-own-exports" "$SERVER_LOG" || fail "no refusal line in the server log"

# LIST: only what the client may open.
list() { run_bounded 20 nbdinfo --list --json "$(uri "$1" "")" | "$PY" -c 'import json,sys; print(" ".join(sorted(e["export-name"] for e in json.load(sys.stdin)["exports"])))'; }
[[ $(list A) == "vdisk/w" ]] || fail "target A lists: $(list A)"
[[ $(list admin) == "vdisk/lin vdisk/w" ]] || fail "the administrator lists: $(list admin)"
log "ok: nbdinfo --list shows target A only vdisk/w, the administrator every vDisk"
stop_pid "$SERVER_PID" 15

serve vdisks
opens anon vdisk/lin
refused anon target/A anonymous-vdisks
refused anon maintenance/w maintenance-needs-admin
log "ok: --anonymous vdisks: read-only vDisks for clients without a certificate, nothing else"
