//! The `vdstream.*` kernel command-line parameters: the one contract between the boot
//! service (which writes them into each target's iPXE script), the initramfs's `/init`
//! (which reads them) and the agent it starts.
//!
//! | parameter | meaning |
//! | --- | --- |
//! | `vdstream.target=ID` | the target record's id |
//! | `vdstream.server=URL` | a store server's API, `http://HOST:PORT` (or `https://`); repeated for failover, tried in order |
//! | `vdstream.vdisk=NAME@V` | the exact version the kernel came from: the agent attaches this version, so kernel and modules match the root |
//! | `vdstream.cache=TYPE` | write cache type (default `ram-overflow`) |
//! | `vdstream.ram=SIZE` | RAM of the write cache in the target, e.g. `256M` |
//! | `vdstream.overflow=DEV` | a local disk or partition for the cache's overflow, e.g. `/dev/sda2`; treated as empty at every boot |
//! | `vdstream.hostname=NAME` | the target's host name (personality) |
//! | `vdstream.machine_id=HEX` | the target's machine-id, 32 hex digits, derived from its id |
//! | `vdstream.on_fail=WHAT` | what `/init` does after a failure it printed (`vdstream-init: FAILED: ...`): `reboot` (default, after 10 s: boot again from the network), `shell` (a busybox shell on the console; leaving it retries) or `halt` |
//!
//! `/init` writes the personality (`/etc/hostname`, `/etc/machine-id`) into the mounted
//! root, so into the target's write cache: the vDisk is never written.
