#!/usr/bin/env bash
# Machine identity with a real TPM (Debian's swtpm, one per "machine"), on a farm with
# `--tls require` and no anonymous grant (docs/IDENTITY.md):
# - pc1's agent with its TPM (`target attach --tpm`) proves its key and waits as pending;
#   `target identity list` shows pc1 pending with the fingerprint the agent printed;
# - approved, the agent gets its certificate by itself, attaches over TLS with it, and the
#   guest's bytes read back through it equal the image; the certificate names target:pc1
#   and its key file is owner-only;
# - a second boot (swtpm restarted on the same state) proves the same key and gets a
#   certificate at once, with no approval;
# - a spoofer (another TPM) claiming pc1 is refused (exit 8): no certificate is written,
#   the server logs the refusal and audit.log has identity.refused; pc1's record keeps its
#   key; the same TPM claiming pc2 waits as pending (pc2 is its own enrolment);
# - without a certificate, target/pc1's export is refused;
# - revoked, pc1's next boot is refused with "revoked".
export VDSTREAM_E2E_TLS=0
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=identity-lib.sh
source "$E2E_DIR/identity-lib.sh"
require nbdinfo nbdcopy cmp openssl curl
require_vdstream
e2e_init
store_init

head -c $((8 << 20)) /dev/urandom >"$E2E_TMP/boot.img"
vds vdisk import boot "$E2E_TMP/boot.img" >/dev/null || fail "vdisk import failed"
for id in pc1 pc2; do
    vds target add "$id" --vdisk boot --cache device-ram --ram 16M >/dev/null || fail "target add $id failed"
done
identity_pki
# A TPM per machine, its state in a folder (the "chip").
tpm_start a
tpm_start b
# NBD over TLS only, no anonymous grant; the API over HTTPS.
identity_server --tls require
log "server: NBD on 127.0.0.1:$ID_PORT (TLS required), API at $ID_API, --identity-ca"
CA_ONLY=$ID_CA_ONLY PORT=$ID_PORT
# boot ID TPM: a machine's boot, waiting at most a minute for its approval.
boot() { identity_boot "$1" "$2" --identity-wait 60s; }
wait_log() {   # FILE REGEX SECS
    local i
    for ((i = 0; i < $3 * 10; i++)); do
        grep -Eq "$2" "$1" && return 0
        sleep 0.1
    done
    fail "${1##*/} never said /$2/ within $3 s: $(tail -n 5 "$1")"
}
identity_json() { vds target identity list --json; }

# --- first boot of pc1: pending, then approved
boot pc1 "$TPM_a"
wait_log "$BOOT_LOG" 'waits for an administrator to approve key sha256:[0-9a-f]{64}' 60
fp=$(grep -Eo 'sha256:[0-9a-f]{64}' "$BOOT_LOG" | head -n1)
assert_eq "pc1's enrolment" "$(identity_json | json_get /dev/stdin '[(e["target"], e["state"], e["key"]["fingerprint"]) for e in j]')" "[('pc1', 'pending', '$fp')]"
[[ -e $BOOT_CERTS ]] && fail "a pending machine got a certificate directory"
vds target identity approve pc1 --fingerprint "$fp" >/dev/null || fail "target identity approve pc1 failed"
wait_log "$BOOT_LOG" "identity of pc1 proved" 30
AGENT_SOCK=$VDSTREAM_RUN_DIR/pc1.sock
wait_ready "$BOOT_PID" "nbd+unix:///?socket=$AGENT_SOCK"
nbdcopy "nbd+unix:///?socket=$AGENT_SOCK" "$E2E_TMP/read.img" || fail "nbdcopy through pc1's agent failed"
cmp "$E2E_TMP/read.img" "$E2E_TMP/boot.img" || fail "pc1 read other bytes than the image"
subject=$(openssl x509 -in "$BOOT_CERTS/client-cert.pem" -noout -ext subjectAltName 2>&1)
[[ $subject == *"urn:vdstream:target:pc1"* ]] || fail "the certificate does not name target:pc1: $subject"
assert_eq "the key file's mode" "$(stat -c %a "$BOOT_CERTS/client-key.pem")" 600
grep -q "target pc1 .* proved key $fp; certificate" "$SERVER_LOG" || fail "the server's log does not say pc1 was certified"
log "ok: pc1 waited as pending, was approved, got target:pc1's certificate and read its vDisk over TLS"
stop_pid "$BOOT_PID" 10

# --- second boot: the same TPM (restarted on its state) is certified at once
tpm_stop a
tpm_start a
boot pc1 "$TPM_a"
wait_log "$BOOT_LOG" "identity of pc1 proved" 60
grep -q "waits for an administrator" "$BOOT_LOG" && fail "the second boot waited for approval again"
wait_ready "$BOOT_PID" "nbd+unix:///?socket=$AGENT_SOCK"
stop_pid "$BOOT_PID" 10
log "ok: the second boot proved the same key and was certified at once"

# --- a spoofer: another TPM claiming pc1
boot pc1 "$TPM_b"
rc=0
wait "$BOOT_PID" || rc=$?
assert_eq "the spoofer's exit status (denied)" "$rc" 8
grep -q "another approved key" "$BOOT_LOG" || fail "the spoofer's console does not say why: $(tail -n 3 "$BOOT_LOG")"
[[ -e $BOOT_CERTS/client-cert.pem ]] && fail "the spoofer got a certificate"
grep -q "identity: refused: target pc1 has another approved key" "$SERVER_LOG" || fail "the server did not log the refusal"
grep -q '"identity.refused"' "$STORE/audit.log" || fail "audit.log has no identity.refused"
assert_eq "pc1's key after the spoofer" "$(identity_json | json_get /dev/stdin '[e["key"]["fingerprint"] for e in j if e["target"] == "pc1"][0]')" "$fp"
log "ok: another TPM claiming pc1 was refused, logged and audited; pc1 kept its key"
boot pc2 "$TPM_b"
wait_log "$BOOT_LOG" 'waits for an administrator' 60
stop_pid "$BOOT_PID" 5
assert_eq "pc2's state" "$(identity_json | json_get /dev/stdin '[e["state"] for e in j if e["target"] == "pc2"][0]')" pending

# --- without a certificate, pc1's export is refused
if out=$(timeout 20 nbdinfo --size "nbds://127.0.0.1:$PORT/target/pc1?tls-certificates=$CA_ONLY" 2>&1); then
    fail "target/pc1 was served to a client without a certificate: $out"
fi
log "ok: target/pc1 refused without a certificate"

# --- revoked: the next boot is refused
vds target identity revoke pc1 >/dev/null || fail "target identity revoke failed"
boot pc1 "$TPM_a"
rc=0
wait "$BOOT_PID" || rc=$?
assert_eq "a revoked machine's exit status (denied)" "$rc" 8
grep -q "revoked" "$BOOT_LOG" || fail "the revoked machine's console does not say so: $(tail -n 3 "$BOOT_LOG")"
log "ok: the revoked machine's boot was refused"

rc=0
stop_pid "$SERVER_PID" 15 || rc=$?
