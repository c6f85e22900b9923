#!/usr/bin/env bash
# The agent over TLS on both sides: its link upstream to a `--tls require` serve-image
# (--tls-certificates, an nbds:// URI) and its local export on TCP with --listen-tls
# require: nbdinfo and qemu-img reach it with TLS, a plaintext client gets TLS_REQD there,
# and the agent's unix socket stays plaintext. A plaintext nbd:// upstream without
# --tls-certificates is refused by the server, and an nbds:// URI without certificates is
# refused at start.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
require nbdinfo qemu-img cmp
require_vdstream
e2e_init
# shellcheck source=tls-lib.sh
source "$E2E_DIR/tls-lib.sh"

make_pki "$E2E_TMP/pki"
# The agent's directory: its target certificate, and a server certificate for its own export.
TLS_CLIENT_DIR=$E2E_TMP/pki/client
issue "$E2E_TMP/pki/ca" "$TLS_CLIENT_DIR" server "DNS:localhost,IP:127.0.0.1"
head -c $((16 << 20)) /dev/urandom >"$E2E_TMP/base.img"
start_tls_server "$E2E_TMP/base.img" --read-only --tls require --tls-certificates "$E2E_TMP/pki/server"
upstream_port=$PORT

agent_port=$(free_port)
start_agent t1 --server "nbds://127.0.0.1:$upstream_port/vdstream?tls-certificates=$TLS_CLIENT_DIR" \
    --cache ram-overflow --ram 16M --listen "127.0.0.1:$agent_port" --listen-tls require
grep -q "as target:pc-01" "$SERVER_LOG" || fail "the server does not know the agent as target:pc-01"
log "ok: the agent's link upstream is TLS, as target:pc-01"

assert_eq "size over the agent's unix socket (plaintext)" "$(run_bounded 20 nbdinfo --size "$URI")" $((16 << 20))
assert_eq "size over the agent's TCP export with TLS" \
    "$(run_bounded 20 nbdinfo --size "nbds://127.0.0.1:$agent_port/?tls-certificates=$TLS_CLIENT_DIR")" $((16 << 20))
rc=0
out=$(run_bounded 20 nbdinfo --size "nbd://127.0.0.1:$agent_port/" 2>&1) || rc=$?
((rc != 0)) && grep -qi "TLS" <<<"$out" || fail "a plaintext client was served by --listen-tls require: $out"
log "ok: plaintext refused on the agent's TLS export"
run_bounded 60 qemu-img convert -O raw --object "tls-creds-x509,id=tls0,dir=$TLS_CLIENT_DIR,endpoint=client" \
    --image-opts "driver=nbd,host=127.0.0.1,port=$agent_port,tls-creds=tls0" "$E2E_TMP/out.img" \
    || fail "qemu-img convert from the agent's TLS export failed"
cmp "$E2E_TMP/base.img" "$E2E_TMP/out.img" || fail "the agent's TLS export read other bytes than the base"
log "ok: qemu-img read the whole disk through the agent, TLS on both sides"
stop_server "$AGENT_PID" 15 || fail "the agent did not stop cleanly"

# Plaintext upstream to a require server: refused (it never attaches within --retry-for).
rc=0
out=$(run_bounded 60 "$VDSTREAM_BIN" target attach t2 --server "nbd://127.0.0.1:$upstream_port/vdstream" --retry-for 3s 2>&1) || rc=$?
((rc != 0)) || fail "the agent attached in plaintext to a --tls require server"
grep -qi "TLS" <<<"$out" || fail "the refusal does not say TLS: $out"
log "ok: a plaintext agent is refused by a --tls require server"

rc=0
out=$("$VDSTREAM_BIN" target attach t3 --server "nbds://127.0.0.1:$upstream_port/vdstream" 2>&1) || rc=$?
((rc != 0)) && grep -q -- "--tls-certificates" <<<"$out" || fail "nbds:// without certificates was not refused clearly: $out"
log "ok: nbds:// without certificates refused at start"
