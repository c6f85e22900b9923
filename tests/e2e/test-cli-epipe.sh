#!/usr/bin/env bash
# Every printing command ends quietly when its reader goes away (EPIPE), as with
# `vdstream audit | head -1`: exit status 0, no panic text ("failed printing to stdout",
# "Broken pipe", "panicked"). Each command runs twice:
#   - with stdout a pipe whose read end is already closed (the first write fails: the
#     case cannot depend on timing or on the output's size);
#   - into `head -1` (the user's case), with an audit trail and a help text long enough
#     to fill the pipe.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
require_vdstream
e2e_init
store_init
export VDSTREAM_RUN_DIR=$E2E_TMP/run
mkdir -p "$VDSTREAM_RUN_DIR"

vds vdisk create w --size 1M >/dev/null
vds target add vm1 --vdisk w --cache device-disk >/dev/null
# A long audit trail (well over the 64 KiB a pipe holds): 100 changes with 1000 bytes each.
long=$(printf 'rack %04d ' $(seq 1 100))
for ((i = 0; i < 100; i++)); do
    vds target set vm1 --description "$i $long" >/dev/null
done
size=$(vds audit | wc -c)
((size > 65536)) || fail "the audit trail is only $size bytes: too short to fill a pipe"

# closed_pipe ARGS... — run vdstream ARGS with stdout a pipe nobody reads; prints
# "STATUS" then stderr.
closed_pipe() {
    "$PY" - "$VDSTREAM_BIN" "$@" <<'PYEOF'
import os, subprocess, sys
r, w = os.pipe()
os.close(r)
p = subprocess.run(sys.argv[1:], stdout=w, stderr=subprocess.PIPE, timeout=60)
print(p.returncode)
sys.stdout.write(p.stderr.decode(errors="replace"))
PYEOF
}

check() {
    local what=$1 rc=$2 err=$3
    if grep -Eqi 'panicked|failed printing|broken pipe' <<<"$err"; then
        fail "$what: panic text on stderr: $err"
    fi
    [[ $rc == 0 ]] || fail "$what: exit status $rc, not 0 (stderr: $err)"
    log "ok: $what: quiet, status 0"
}

cmds=(
    "--help"
    "audit --store $STORE"
    "audit --store $STORE --json"
    "vdisk list --store $STORE"
    "vdisk info w --store $STORE"
    "vdisk info w --store $STORE --json"
    "version list w --store $STORE"
    "target list --store $STORE"
    "target show vm1 --store $STORE"
    "vdisk --help"
)
for c in "${cmds[@]}"; do
    # shellcheck disable=SC2086 # c is a list of words
    out=$(closed_pipe $c)
    check "vdstream $c > closed pipe" "$(head -n1 <<<"$out")" "$(tail -n +2 <<<"$out")"
done

for c in "audit --store $STORE" "audit --store $STORE --json" "--help" "server --help"; do
    # shellcheck disable=SC2086
    first=$("$VDSTREAM_BIN" $c 2>"$E2E_TMP/err.txt" | head -n1; echo "rc=${PIPESTATUS[0]}")
    rc=${first##*rc=}
    [[ -n ${first%%rc=*} ]] || fail "vdstream $c | head -1 printed nothing"
    check "vdstream $c | head -1" "$rc" "$(cat "$E2E_TMP/err.txt")"
done

# A service outlives its closed stdout: serve-image keeps serving (its SIGPIPE stays
# ignored: a client that leaves must not kill it), then stops on SIGTERM with status 0.
sock=$E2E_TMP/mem.sock
"$PY" - "$VDSTREAM_BIN" "$sock" <<'PYEOF' || fail "serve-image with a closed stdout: see above"
import os, signal, subprocess, sys, time
binary, sock = sys.argv[1:]
r, w = os.pipe()
os.close(r)
p = subprocess.Popen([binary, "serve-image", "--memory", "1M", "--socket", sock], stdout=w, stderr=subprocess.PIPE)
os.close(w)
deadline = time.time() + 20
while not os.path.exists(sock):
    assert p.poll() is None, f"serve-image exited with {p.returncode}: {p.stderr.read().decode()}"
    assert time.time() < deadline, "no socket within 20 s"
    time.sleep(0.1)
for _ in range(3):  # clients that come and go
    out = subprocess.run(["nbdinfo", "--size", f"nbd+unix:///?socket={sock}"], capture_output=True, timeout=20)
    assert out.returncode == 0 and out.stdout.strip() == b"1048576", out
assert p.poll() is None, "serve-image died"
p.send_signal(signal.SIGTERM)
err = p.communicate(timeout=30)[1].decode()
assert p.returncode == 0, f"status {p.returncode}: {err}"
assert "panicked" not in err and "Broken pipe" not in err, err
print("serve-image served with its stdout closed and stopped with status 0")
PYEOF
log "ok: serve-image served with a closed stdout"
