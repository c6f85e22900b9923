#!/usr/bin/env bash
# Multi-conn: the export advertises can_multi_conn, and with two connections a write on
# one followed by a flush (on the writer, if the export offers flush) is seen by a read on the other, both ways,
# including for trim and zero.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh
require_python_nbd
e2e_init

img=$E2E_TMP/disk.img
truncate -s 32M "$img"
for args in "--memory 32M" "$img"; do
    # shellcheck disable=SC2086
    start_server $args
    nbdsh_script "
import os
a = h
b = nbd.NBD()
b.connect_uri('$URI')
assert a.can_multi_conn() and b.can_multi_conn(), 'can_multi_conn not advertised'
d1, d2 = os.urandom(1 << 20), os.urandom(1 << 20)
a.pwrite(d1, 0); flush_if_offered(a)
assert b.pread(1 << 20, 0) == d1, 'B does not see A\'s flushed write'
b.pwrite(d2, 4 << 20); flush_if_offered(b)
assert a.pread(1 << 20, 4 << 20) == d2, 'A does not see B\'s flushed write'
a.zero(1 << 20, 0); flush_if_offered(a)
assert b.pread(1 << 20, 0) == bytes(1 << 20), 'B does not see A\'s zero'
b.trim(1 << 20, 4 << 20); flush_if_offered(b)
got = a.pread(1 << 20, 4 << 20)
assert got in (d2, bytes(1 << 20)), 'A sees garbage after B\'s trim'
b.shutdown()
"
done
