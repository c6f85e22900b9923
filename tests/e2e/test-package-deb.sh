#!/usr/bin/env bash
# The Debian package, installed for real: packaging/build-deb makes
# target/debian/vdstream_*.deb from the binary under test (target/PROFILE/vdstream),
# `apt-get install ./…deb`
# installs it, and then what an administrator relies on is checked:
# - the files: the binary, vdstream-server.service and vdstream-agent@.service, the
#   README, LICENSE and guides (docs/, which the README links to) under /usr/share/doc,
#   /etc/vdstream/server.toml (a conffile, readable by the group vdstream), man pages that
#   `man` finds, bash completions that complete a subcommand;
# - the system user vdstream, and the demo vDisk in a new store /var/lib/vdstream/store;
# - the server unit's ExecStart line, run as the unit runs it (its User, Environment and
#   RuntimeDirectory; systemd itself is absent here), serves the demo vDisk on the unit's
#   socket and on 127.0.0.1:10809, and drains on SIGTERM with status 0 (and
#   `systemd-analyze verify` passes both units);
# - the agent template's ExecStart line for target t1, with an env file as the unit reads
#   it, attaches t1 and offers its disk on /run/vdstream/t1.sock (written and read back);
# - `apt-get purge` removes the package and keeps the store (the farm's vDisks).
# Needs root (apt); the machine is left as found: an earlier vdstream package, user or
# state is refused rather than touched.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo qemu-io dpkg-deb apt-get setpriv systemd-analyze
require_vdstream
[[ $(id -u) == 0 ]] || fail "installs a package: run as root (CI does)"
e2e_init
cd "$E2E_DIR/../.."

if dpkg -s vdstream >/dev/null 2>&1 || getent passwd vdstream >/dev/null || [[ -e /var/lib/vdstream || -e /etc/vdstream ]]; then
    fail "this machine already has a vdstream package, user or state (/var/lib/vdstream, /etc/vdstream): the test would change it"
fi
purge_all() {
    dpkg -s vdstream >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get purge -y -q vdstream >/dev/null 2>&1
    getent passwd vdstream >/dev/null && deluser --quiet --system vdstream >/dev/null 2>&1
    getent group vdstream >/dev/null && delgroup --quiet --system vdstream >/dev/null 2>&1
    rm -rf /var/lib/vdstream /var/cache/vdstream /run/vdstream /etc/vdstream
}
E2E_CLEANUP_HOOKS+=(purge_all)

log "building the package"
profile=$(basename "$(dirname "$VDSTREAM_BIN")")
[[ $VDSTREAM_BIN -ef target/$profile/vdstream ]] || fail "VDSTREAM_BIN=$VDSTREAM_BIN is not a Cargo build of this tree (target/PROFILE/vdstream): the package is made from one"
packaging/build-deb --no-build --profile "$profile" >"$E2E_TMP/build.log" 2>&1 || { tail -20 "$E2E_TMP/build.log" >&2; fail "packaging/build-deb failed"; }
grep -i '^warning' "$E2E_TMP/build.log" && fail "packaging/build-deb warned (above)"
deb=$(ls target/debian/vdstream_*.deb)
grep -q "Depends:.*adduser" <<<"$(dpkg-deb -I "$deb")" || fail "the package does not depend on adduser, which its postinst uses"

log "installing $deb"
DEBIAN_FRONTEND=noninteractive apt-get install -y -q "./$deb" >"$E2E_TMP/apt.log" 2>&1 || { tail -20 "$E2E_TMP/apt.log" >&2; fail "apt-get install ./$deb failed"; }
grep -q "^Status: install ok installed" <<<"$(dpkg -s vdstream)" || fail "dpkg does not list vdstream as installed"
# Without systemd (as here) the install says that nothing was started, and how to start it.
if [[ ! -d /run/systemd/system ]]; then
    grep -q "systemd is not running here" "$E2E_TMP/apt.log" || fail "the install without systemd does not say the server was not started: $(tail -5 "$E2E_TMP/apt.log")"
    grep -q "vdstream server --config /etc/vdstream/server.toml" "$E2E_TMP/apt.log" || fail "the install without systemd does not say how to start the server"
    log "ok: without systemd the install says how to start the server"
fi
for f in /usr/bin/vdstream /lib/systemd/system/vdstream-server.service /lib/systemd/system/vdstream-agent@.service \
    /etc/vdstream/server.toml /usr/share/bash-completion/completions/vdstream /usr/share/man/man1/vdstream-server.1.gz \
    /usr/share/doc/vdstream/README.md /usr/share/doc/vdstream/LICENSE /usr/share/doc/vdstream/docs/ADMIN.md \
    /usr/share/doc/vdstream/docs/SECURITY.md /usr/share/doc/vdstream/docs/openapi.json; do
    [[ -e $f ]] || fail "the package did not install $f"
done
grep -qx "/etc/vdstream/server.toml" /var/lib/dpkg/info/vdstream.conffiles || fail "/etc/vdstream/server.toml is not a conffile (an upgrade would overwrite the administrator's edits)"
grep -q "^vdstream " <<<"$(/usr/bin/vdstream --version)" || fail "/usr/bin/vdstream --version: $(/usr/bin/vdstream --version)"

# The user and the store.
grep -q ":/var/lib/vdstream:" <<<"$(getent passwd vdstream)" || fail "no system user vdstream with home /var/lib/vdstream: $(getent passwd vdstream)"
[[ $(stat -c %G /etc/vdstream/server.toml) == vdstream ]] || fail "/etc/vdstream/server.toml is not readable by the group vdstream"
[[ $(stat -c %U /var/lib/vdstream/store/store.json) == vdstream ]] || fail "the store is not the user vdstream's"
grep -q '"demo"' <<<"$(VDSTREAM_STORE=/var/lib/vdstream/store /usr/bin/vdstream vdisk list --json)" || fail "the new store has no demo vDisk"

# Man pages and completions.
if command -v man >/dev/null; then
    man -w vdstream-target-attach >/dev/null 2>&1 || fail "man does not find vdstream-target-attach"
fi
grep -q "Serve every vDisk of the store" <<<"$(zcat /usr/share/man/man1/vdstream-server.1.gz)" || fail "vdstream-server(1) does not describe the server"
got=$(bash -c 'source /usr/share/bash-completion/completions/vdstream
    COMP_WORDS=(vdstream ser); COMP_CWORD=1; COMP_LINE="vdstream ser"; COMP_POINT=${#COMP_LINE}
    _clap_complete_vdstream vdstream ser vdstream; echo "${COMPREPLY[*]}"')
[[ " $got " == *" server "* && " $got " == *" serve-image "* ]] || fail "bash completion of 'vdstream ser' gave '$got', want server and serve-image"
log "ok: files, conffile, user, demo vDisk, man pages, completions"

# The units as systemd reads them (syntax, the binary, the man pages they name).
mkdir -p "$E2E_TMP/units"
cp /lib/systemd/system/vdstream-agent@.service "$E2E_TMP/units/vdstream-agent@t1.service"
for u in /lib/systemd/system/vdstream-server.service "$E2E_TMP/units/vdstream-agent@t1.service"; do
    systemd-analyze verify "$u" >"$E2E_TMP/verify.log" 2>&1 || { cat "$E2E_TMP/verify.log" >&2; fail "systemd-analyze verify ${u##*/} failed"; }
    [[ ! -s $E2E_TMP/verify.log ]] || { cat "$E2E_TMP/verify.log" >&2; fail "systemd-analyze verify ${u##*/} warns"; }
done
log "ok: systemd-analyze verify passes both units"

# unit_value UNIT KEY — the value of KEY= in the installed unit (the last one).
unit_value() { sed -n "s/^$2=//p" "/lib/systemd/system/$1" | tail -1; }

# run_unit UNIT ENVFILE LOG INSTANCE — start UNIT's ExecStart as systemd would: as its
# User and Group, with its Environment= and EnvironmentFile= (${VAR} is one word, $VAR
# splits on white space), %i as INSTANCE, and its RuntimeDirectory made; sets UNIT_PID.
run_unit() {
    local unit=$1 envfile=$2 logf=$3 inst=${4:-} line user group envs
    line=$(unit_value "$unit" ExecStart)
    user=$(unit_value "$unit" User) group=$(unit_value "$unit" Group)
    [[ -n $line && $user == vdstream && $group == vdstream ]] || fail "$unit: ExecStart '$line', User '$user', Group '$group'"
    install -d -o "$user" -g "$group" -m 0755 /run/vdstream
    install -d -o "$user" -g "$group" -m 0750 /var/cache/vdstream
    envs=$(sed -n 's/^Environment=//p' "/lib/systemd/system/$unit" | tr '\n' ' ')
    line=${line//%i/$inst}
    (
        set -a
        eval "export $envs"
        [[ -n $envfile ]] && source "$envfile"
        set +a
        cd /
        # shellcheck disable=SC2086 # the word splitting systemd does for $VAR
        eval "exec setpriv --reuid $user --regid $group --init-groups -- $line"
    ) >"$logf" 2>&1 </dev/null &
    UNIT_PID=$!
    track_pid "$UNIT_PID"
    E2E_SERVER_LOGS+=("$logf")
}

log "running vdstream-server.service's ExecStart as user vdstream"
run_unit vdstream-server.service "" "$E2E_TMP/server.log"
server_pid=$UNIT_PID
wait_ready "$server_pid" 'nbd+unix:///vdisk/demo?socket=/run/vdstream/server.sock'
size=$(nbdinfo --size 'nbd+unix:///vdisk/demo?socket=/run/vdstream/server.sock') || fail "the unit's socket does not serve vdisk/demo"
[[ $size == 1073741824 ]] || fail "vdisk/demo is $size bytes, want 1 GiB"
size=$(nbdinfo --size nbd://127.0.0.1:10809/vdisk/demo) || fail "127.0.0.1:10809 does not serve vdisk/demo"
[[ $(stat -c %U /proc/"$server_pid") == vdstream ]] || fail "the server runs as $(stat -c %U /proc/"$server_pid"), want vdstream"
log "ok: the server unit serves vdisk/demo on /run/vdstream/server.sock and 127.0.0.1:10809 as user vdstream"

log "running vdstream-agent@t1.service's ExecStart with /etc/vdstream/agent/t1.env"
install -d /etc/vdstream/agent
grep -v '^VDSTREAM_ATTACH_ARGS=' /usr/share/doc/vdstream/agent.env.example >/etc/vdstream/agent/t1.env
echo 'VDSTREAM_ATTACH_ARGS="--cache ram-overflow --ram 64M"' >>/etc/vdstream/agent/t1.env
run_unit vdstream-agent@.service /etc/vdstream/agent/t1.env "$E2E_TMP/agent.log" t1
agent_pid=$UNIT_PID
wait_ready "$agent_pid" 'nbd+unix:///?socket=/run/vdstream/t1.sock'
qemu-io -f raw -c 'write -P 0x5a 1M 64k' 'nbd+unix:///?socket=/run/vdstream/t1.sock' >/dev/null || fail "writing through t1's socket failed"
grep -q "read 65536/65536" <<<"$(qemu-io -f raw -c 'read -P 0x5a 1M 64k' 'nbd+unix:///?socket=/run/vdstream/t1.sock')" || fail "t1 did not read back its write"
log "ok: the agent unit attaches t1 and its socket reads back a write"

stop_pid "$agent_pid" 15
rc=0
stop_server "$server_pid" 30 || rc=$?
((rc == 0)) || { cat "$E2E_TMP/server.log" >&2; fail "the server exited with status $rc on SIGTERM, want 0 (a drain)"; }
log "ok: SIGTERM drains the server, status 0"

DEBIAN_FRONTEND=noninteractive apt-get purge -y -q vdstream >"$E2E_TMP/purge.log" 2>&1 || { tail -20 "$E2E_TMP/purge.log" >&2; fail "apt-get purge vdstream failed"; }
[[ ! -e /usr/bin/vdstream && ! -e /lib/systemd/system/vdstream-server.service ]] || fail "purge left the binary or the unit"
[[ -e /var/lib/vdstream/store/store.json ]] || fail "purge removed the store: the farm's vDisks must be kept"
log "ok: purge removes the package and keeps the store"
