#!/usr/bin/env bash
# The agent's link upstream over NBD TLS through server failures: the existing kill tests
# (test-agent-server-kill.sh: SIGKILL and restart mid-fio; test-agent-failover.sh: SIGKILL
# and move to the second server) run again with VDSTREAM_E2E_TLS=1 (servers with --tls
# require and openssl-made certificates, the agent with --tls-certificates): fio's verify
# passes, the agent reconnects or fails over, over TLS.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require fio nbdinfo openssl
require_vdstream
for t in test-agent-server-kill.sh test-agent-failover.sh; do
    log "running $t with TLS"
    VDSTREAM_E2E_TLS=1 bash "$E2E_DIR/$t" || fail "$t failed over TLS"
    log "ok: $t passes over TLS"
done
