#!/usr/bin/env bash
# The libvirt domain examples (packaging/libvirt/): a VM target whose disk is its agent's
# unix socket, and one whose agent offers the disk on TCP with TLS. Both validate against
# libvirt's schema (virt-xml-validate) and are taken by `virsh define` (libvirt's test
# driver, no daemon), which keeps the NBD source as written. The socket example, pointed
# at a real agent's socket, names a disk that qemu-io writes and reads back through the
# agent (and shows the vDisk's bytes elsewhere); the TLS example keeps tls='yes' and the
# agent's host and port.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
require virsh virt-xml-validate xmllint qemu-io nbdinfo nbdcopy cmp
require_vdstream
e2e_init
examples=$E2E_DIR/../../packaging/libvirt

for f in vm1-agent-socket.xml vm1-agent-tls.xml; do
    virt-xml-validate "$examples/$f" domain >"$E2E_TMP/validate.log" 2>&1 || { cat "$E2E_TMP/validate.log" >&2; fail "$f does not validate against libvirt's domain schema"; }
done
log "ok: both examples validate"

# defined_source FILE XPATH — define FILE in a fresh test driver, print XPATH of the domain
# libvirt keeps (its dumpxml).
defined_source() {
    virsh -q -c test:///default "define $1; dumpxml vm1" >"$E2E_TMP/dump.out" 2>&1 || { cat "$E2E_TMP/dump.out" >&2; fail "virsh define $1 failed"; }
    sed -n '/<domain/,$p' "$E2E_TMP/dump.out" >"$E2E_TMP/dump.xml"
    xmllint --xpath "$2" "$E2E_TMP/dump.xml"
}

# The socket example, with a real agent's socket in place of /run/vdstream/vm1.sock.
head -c $((16 << 20)) /dev/urandom >"$E2E_TMP/base.img"
start_server "$E2E_TMP/base.img" --read-only
start_agent vm1 --server "$URI" --cache ram-overflow --ram 16M
grep -q "socket='/run/vdstream/vm1.sock'" "$examples/vm1-agent-socket.xml" || fail "the socket example does not name /run/vdstream/vm1.sock, the agent unit's socket"
sed "s|/run/vdstream/vm1.sock|$AGENT_SOCK|" "$examples/vm1-agent-socket.xml" >"$E2E_TMP/vm1.xml"
[[ $(defined_source "$E2E_TMP/vm1.xml" 'string(//disk[@type="network"]/source/@protocol)') == nbd ]] || fail "libvirt did not keep the nbd source"
sock=$(defined_source "$E2E_TMP/vm1.xml" 'string(//disk[@type="network"]/source/host/@socket)')
[[ $sock == "$AGENT_SOCK" ]] || fail "libvirt keeps the socket '$sock', want $AGENT_SOCK"
qemu-io -f raw -c 'write -P 0x7e 2M 128k' "nbd+unix:///?socket=$sock" >/dev/null || fail "writing the domain's disk failed"
grep -q "read 131072/131072" <<<"$(qemu-io -f raw -c 'read -P 0x7e 2M 128k' "nbd+unix:///?socket=$sock")" || fail "the domain's disk did not read back its write"
cmp -n $((2 << 20)) "$E2E_TMP/base.img" <(nbdcopy "nbd+unix:///?socket=$sock" - 2>/dev/null) || fail "the domain's disk does not show the vDisk before the write"
log "ok: the socket example's disk is the agent's, and reads back a write"

# The TLS example.
[[ $(defined_source "$examples/vm1-agent-tls.xml" 'string(//disk[@type="network"]/source/@tls)') == yes ]] || fail "libvirt did not keep tls='yes'"
hp=$(defined_source "$examples/vm1-agent-tls.xml" 'concat(//disk[@type="network"]/source/host/@name, ":", //disk[@type="network"]/source/host/@port)')
[[ $hp == storage1:10810 ]] || fail "libvirt keeps the host $hp, want storage1:10810"
log "ok: the TLS example keeps tls='yes' and storage1:10810"
