# shellcheck shell=bash
# tests/e2e/garage-lib.sh — a real 3-node Garage cluster on 127.0.0.1 for the s3:// store
# tests (source after lib.sh).
#
#   garage_start        three nodes, replication factor 3, consistent mode, one layout;
#                       a bucket "vdstream-test" and a key with read/write on it. Exports
#                       AWS_ENDPOINT_URL (node 1's S3 port), AWS_REGION, AWS_ACCESS_KEY_ID,
#                       AWS_SECRET_ACCESS_KEY. Sets GARAGE_PIDS (node 1..3).
#   garage_cli N ARGS   `garage` against node N's config
#   garage_kill N       SIGKILL node N
#
# The garage binary: $GARAGE_BIN, else `garage` on PATH (scripts/test installs it).

GARAGE_BIN=${GARAGE_BIN:-$(command -v garage || true)}
GARAGE_PIDS=()
GARAGE_KEY_ID=GK0123456789abcdef01234567
GARAGE_SECRET=0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef

garage_cli() { local n=$1; shift; "$GARAGE_BIN" -c "$E2E_TMP/garage$n/garage.toml" "$@"; }

garage_kill() { kill -KILL "${GARAGE_PIDS[$(($1 - 1))]}" 2>/dev/null || true; }

# Three free TCP ports per node (rpc, s3, admin), from the kernel.
garage_ports() {
    "$PY" - <<'PYEOF'
import socket
socks = []
for _ in range(9):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PYEOF
}

garage_start() {
    [[ -x $GARAGE_BIN ]] || fail "garage not found: scripts/test installs it (cargo install garage), or set GARAGE_BIN"
    local ports n secret deadline id ids
    read -ra ports <<<"$(garage_ports)"
    secret=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
    for n in 1 2 3; do
        mkdir -p "$E2E_TMP/garage$n"
        cat >"$E2E_TMP/garage$n/garage.toml" <<EOF
metadata_dir = "$E2E_TMP/garage$n/meta"
data_dir = "$E2E_TMP/garage$n/data"
db_engine = "lmdb"
replication_factor = 3
consistency_mode = "consistent"
rpc_bind_addr = "127.0.0.1:${ports[$(((n - 1) * 3))]}"
rpc_public_addr = "127.0.0.1:${ports[$(((n - 1) * 3))]}"
rpc_secret = "$secret"
rpc_timeout_msec = 5000
bootstrap_peers = []

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:${ports[$(((n - 1) * 3 + 1))]}"

[admin]
api_bind_addr = "127.0.0.1:${ports[$(((n - 1) * 3 + 2))]}"
EOF
        RUST_LOG=warn "$GARAGE_BIN" -c "$E2E_TMP/garage$n/garage.toml" server >"$E2E_TMP/garage$n.log" 2>&1 </dev/null &
        GARAGE_PIDS+=("$!")
        E2E_PIDS+=("$!")
    done
    deadline=$((SECONDS + 30))
    ids=()
    for n in 1 2 3; do
        until id=$(garage_cli "$n" node id -q 2>/dev/null); do
            ((SECONDS < deadline)) || fail "garage node $n did not start (see $E2E_TMP/garage$n.log)"
            sleep 0.2
        done
        ids+=("$id")
    done
    for id in "${ids[@]:1}"; do
        garage_cli 1 node connect "$id" >/dev/null
    done
    for id in "${ids[@]}"; do
        garage_cli 1 layout assign -z dc1 -c 1G "${id%%@*}" >/dev/null
    done
    garage_cli 1 layout apply --version 1 >/dev/null
    until garage_cli 1 status 2>/dev/null | grep -q HEALTHY || garage_cli 1 bucket list >/dev/null 2>&1; do
        ((SECONDS < deadline)) || fail "the garage cluster did not become healthy"
        sleep 0.2
    done
    # The layout takes a moment to reach every node: retry the first write until it does.
    until garage_cli 1 bucket create vdstream-test >/dev/null 2>"$E2E_TMP/garage-bucket.err"; do
        ((SECONDS < deadline)) || fail "garage: bucket create failed: $(cat "$E2E_TMP/garage-bucket.err")"
        sleep 0.3
    done
    garage_cli 1 key import --yes -n vdstream "$GARAGE_KEY_ID" "$GARAGE_SECRET" >/dev/null
    garage_cli 1 bucket allow --read --write --owner vdstream-test --key "$GARAGE_KEY_ID" >/dev/null
    export AWS_ENDPOINT_URL="http://127.0.0.1:${ports[1]}" AWS_REGION=garage
    export AWS_ACCESS_KEY_ID=$GARAGE_KEY_ID AWS_SECRET_ACCESS_KEY=$GARAGE_SECRET
    GARAGE_S3_PORTS=("${ports[1]}" "${ports[4]}" "${ports[7]}")
    log "garage: 3 nodes up, S3 at $AWS_ENDPOINT_URL"
}
