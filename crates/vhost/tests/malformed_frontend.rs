//! A hostile frontend: a small vhost-user frontend (the vhost crate's `Frontend`, guest
//! memory in two memfds with a hole between them) that hands the backend, over its real
//! socket, descriptor chains no driver would build. Each fails alone; the backend keeps
//! serving, and never touches memory outside what the frontend gave it.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vdstream_blockdev::{BlockDev, MemoryDev};
use vdstream_vhost::driver::{header, Desc, Seg, SplitRing, NEXT, WRITE};
use vdstream_vhost::{Options, VhostServer};
use vhost::vhost_user::message::VhostUserHeaderFlag;
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::bindings::virtio_blk::*;
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

const MIB: u64 = 1 << 20;
/// Guest memory: [0, 1 MiB) and [2 MiB, 3 MiB).
const HOLE: u64 = MIB + 0x1000;
const HIGH: u64 = 2 * MIB;
const DATA: u64 = 0x10000;

fn memfd(len: u64) -> File {
    // SAFETY: memfd_create with a NUL-terminated name; the fd is owned by the File.
    let fd = unsafe { libc::memfd_create(c"vdstream-test".as_ptr(), 0) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a new descriptor nobody else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).unwrap();
    f
}

struct Guest {
    mem: GuestMemoryMmap,
    ring: SplitRing,
    kick: EventFd,
    _frontend: Frontend,
}

impl Guest {
    fn connect(path: &std::path::Path) -> Guest {
        Guest::try_connect(path, MIB).expect("a well-formed memory table is taken")
    }

    /// A frontend whose memory regions (1 MiB each) are backed by memfds of `file_len` bytes.
    fn try_connect(path: &std::path::Path, file_len: u64) -> Result<Guest, vhost::Error> {
        let mut fe = Frontend::connect(path, 1)?;
        fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        let features = fe.get_features()?;
        fe.set_owner()?;
        fe.set_features(features)?;
        let proto = fe.get_protocol_features()?;
        fe.set_protocol_features(proto)?;
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files(&[
            (
                GuestAddress(0),
                MIB as usize,
                Some(FileOffset::new(memfd(file_len), 0)),
            ),
            (
                GuestAddress(HIGH),
                MIB as usize,
                Some(FileOffset::new(memfd(file_len), 0)),
            ),
        ])
        .unwrap();
        let regions: Vec<VhostUserMemoryRegionInfo> = mem
            .iter()
            .map(|r| VhostUserMemoryRegionInfo::from_guest_region(r).unwrap())
            .collect();
        fe.set_mem_table(&regions)?;
        let mut ring = SplitRing::at(0, 16);
        ring.init(&mem);
        let host = |a: GuestAddress| mem.get_host_address(a).unwrap() as u64;
        fe.set_vring_num(0, 16).unwrap();
        fe.set_vring_base(0, 0).unwrap();
        let config = VringConfigData {
            queue_max_size: 16,
            queue_size: 16,
            flags: 0,
            desc_table_addr: host(ring.desc),
            used_ring_addr: host(ring.used),
            avail_ring_addr: host(ring.avail),
            log_addr: None,
        };
        fe.set_vring_addr(0, &config).unwrap();
        let kick = EventFd::new(0).unwrap();
        let call = EventFd::new(0).unwrap();
        fe.set_vring_kick(0, &kick).unwrap();
        fe.set_vring_call(0, &call).unwrap();
        fe.set_vring_enable(0, true).unwrap();
        Ok(Guest {
            mem,
            ring,
            kick,
            _frontend: fe,
        })
    }

    /// A well-formed 512-byte read is answered OK, as the `n`th chain given back.
    fn read_is_served(&mut self, n: u16) {
        self.mem
            .write_slice(&header(VIRTIO_BLK_T_IN, 0), GuestAddress(DATA))
            .unwrap();
        let segs = [
            Seg {
                addr: DATA,
                len: 16,
                write: false,
            },
            Seg {
                addr: DATA + 0x1000,
                len: 512,
                write: true,
            },
            Seg {
                addr: DATA + 0x100,
                len: 1,
                write: true,
            },
        ];
        self.ring.add_chain(&self.mem, &segs);
        self.kick_and_wait(n);
        assert_eq!(
            self.mem.read_obj::<u8>(GuestAddress(DATA + 0x100)).unwrap(),
            VIRTIO_BLK_S_OK as u8
        );
    }

    /// Kicks and waits (at most 5 s) until the device has given back `n` chains in all.
    fn kick_and_wait(&self, n: u16) {
        self.kick.write(1).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.ring.used_idx(&self.mem) != n {
            assert!(
                Instant::now() < deadline,
                "the device gave back {} chains, not {n}",
                self.ring.used_idx(&self.mem)
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

#[test]
fn malformed_chains_over_the_socket_fail_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.vhost");
    let dev = Arc::new(MemoryDev::new(4 * MIB));
    let mut server = VhostServer::start(
        UnixListener::bind(&path).unwrap(),
        &path,
        dev.clone(),
        Options::default(),
        "hostile",
    )
    .unwrap();
    let mut g = Guest::connect(&path);
    let h = DATA;
    let s = DATA + 0x100;
    let good_data = DATA + 0x1000;
    // Canary: a writable buffer the device must not touch, right after a read's data.
    g.mem
        .write_slice(&[0x77u8; 4096], GuestAddress(DATA + 0x3000))
        .unwrap();
    dev.write_at(&[0x42u8; 4096], 0, false).unwrap();
    let ioerr = VIRTIO_BLK_S_IOERR as u8;
    let cases: Vec<(&str, Vec<Seg>, Option<u8>)> = vec![
        (
            "data in the hole",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: HOLE,
                    len: 4096,
                    write: true,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
            Some(ioerr),
        ),
        (
            "data across the end of a region",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: MIB - 512,
                    len: 4096,
                    write: true,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
            Some(ioerr),
        ),
        (
            "readable after writable",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
                Seg {
                    addr: good_data,
                    len: 512,
                    write: false,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
            Some(ioerr),
        ),
        (
            "a short header",
            vec![
                Seg {
                    addr: h,
                    len: 4,
                    write: false,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
            Some(ioerr),
        ),
        (
            "no status",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: good_data,
                    len: 512,
                    write: false,
                },
            ],
            None,
        ),
        (
            "the status in the hole",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: HOLE,
                    len: 1,
                    write: true,
                },
            ],
            None,
        ),
        (
            "lengths that overflow",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: HIGH,
                    len: u32::MAX,
                    write: true,
                },
                Seg {
                    addr: HIGH,
                    len: u32::MAX,
                    write: true,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
            None,
        ),
    ];
    let mut given_back = 0u16;
    for (what, segs, want) in &cases {
        g.mem
            .write_slice(&header(VIRTIO_BLK_T_IN, 0), GuestAddress(h))
            .unwrap();
        g.mem.write_obj(0xffu8, GuestAddress(s)).unwrap();
        let head = g.ring.add_chain(&g.mem, segs);
        given_back += 1;
        g.kick_and_wait(given_back);
        let (id, len) = g.ring.used_elem(&g.mem, given_back - 1);
        assert_eq!(id, u32::from(head), "{what}");
        let status: u8 = g.mem.read_obj(GuestAddress(s)).unwrap();
        match want {
            Some(st) => assert_eq!((status, len), (*st, 1), "{what}: IOERR in the status byte"),
            None => assert_eq!((status, len), (0xff, 0), "{what}: given back unanswered"),
        }
    }
    // A loop (5 -> 6 -> 5) and a next index past the queue.
    g.ring.write_desc(
        &g.mem,
        4,
        Desc {
            addr: h,
            len: 16,
            flags: NEXT,
            next: 5,
        },
    );
    g.ring.write_desc(
        &g.mem,
        5,
        Desc {
            addr: good_data,
            len: 512,
            flags: NEXT | WRITE,
            next: 6,
        },
    );
    g.ring.write_desc(
        &g.mem,
        6,
        Desc {
            addr: good_data + 512,
            len: 512,
            flags: NEXT | WRITE,
            next: 5,
        },
    );
    g.ring.publish(&g.mem, 4);
    g.ring.write_desc(
        &g.mem,
        7,
        Desc {
            addr: h,
            len: 16,
            flags: NEXT,
            next: 300,
        },
    );
    g.ring.publish(&g.mem, 7);
    given_back += 2;
    g.kick_and_wait(given_back);
    // The backend still serves: a good read, and the canary after it is untouched.
    g.mem
        .write_slice(&header(VIRTIO_BLK_T_IN, 0), GuestAddress(h))
        .unwrap();
    g.ring.add_chain(
        &g.mem,
        &[
            Seg {
                addr: h,
                len: 16,
                write: false,
            },
            Seg {
                addr: DATA + 0x2000,
                len: 4096,
                write: true,
            },
            Seg {
                addr: s,
                len: 1,
                write: true,
            },
        ],
    );
    given_back += 1;
    g.kick_and_wait(given_back);
    assert_eq!(
        g.mem.read_obj::<u8>(GuestAddress(s)).unwrap(),
        VIRTIO_BLK_S_OK as u8
    );
    let mut back = [0u8; 4096];
    g.mem
        .read_slice(&mut back, GuestAddress(DATA + 0x2000))
        .unwrap();
    assert_eq!(back, [0x42u8; 4096]);
    g.mem
        .read_slice(&mut back, GuestAddress(DATA + 0x3000))
        .unwrap();
    assert_eq!(
        back, [0x77u8; 4096],
        "nothing past the read's buffer was written"
    );
    let f = server.figures();
    assert_eq!(f.malformed, 9, "{f:?}");
    assert_eq!(f.requests, 10, "{f:?}");
    drop(g);
    server.stop();
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn a_queue_whose_available_index_runs_ahead_stops_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.vhost");
    let mut server = VhostServer::start(
        UnixListener::bind(&path).unwrap(),
        &path,
        Arc::new(MemoryDev::new(4 * MIB)),
        Options::default(),
        "ahead",
    )
    .unwrap();
    let g = Guest::connect(&path);
    // avail.idx 100 ahead on a queue of 16: no chain can be taken; the backend must not spin.
    g.mem
        .write_obj(100u16, GuestAddress(g.ring.avail.0 + 2))
        .unwrap();
    g.kick.write(1).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.figures().malformed == 0 {
        assert!(
            Instant::now() < deadline,
            "the runaway index was never noticed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(g.ring.used_idx(&g.mem), 0);
    drop(g);
    // The next frontend is served.
    let mut g = Guest::connect(&path);
    g.read_is_served(1);
    let started = Instant::now();
    server.stop();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stop took {:?}",
        started.elapsed()
    );
}

#[test]
fn a_memory_file_shorter_than_its_region_is_refused_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.vhost");
    let mut server = VhostServer::start(
        UnixListener::bind(&path).unwrap(),
        &path,
        Arc::new(MemoryDev::new(4 * MIB)),
        Options::default(),
        "short",
    )
    .unwrap();
    // Touching the missing half of such a mapping raises SIGBUS: the backend refuses it.
    assert!(
        Guest::try_connect(&path, MIB / 2).is_err(),
        "a memory table over short files is refused"
    );
    let mut g = Guest::connect(&path);
    g.read_is_served(1);
    drop(g);
    server.stop();
}

#[test]
fn connections_do_not_leak_file_descriptors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.vhost");
    let opts = Options {
        queues: 4,
        threads: 4,
        ..Options::default()
    };
    let mut server = VhostServer::start(
        UnixListener::bind(&path).unwrap(),
        &path,
        Arc::new(MemoryDev::new(4 * MIB)),
        opts,
        "fds",
    )
    .unwrap();
    let cycle = || {
        let g = Guest::connect(&path);
        let n = server.figures().connections;
        drop(g);
        let deadline = Instant::now() + Duration::from_secs(5);
        while server.figures().connected || server.figures().connections == n - 1 {
            assert!(Instant::now() < deadline, "the disconnect was not noticed");
            std::thread::sleep(Duration::from_millis(5));
        }
        // The accept thread makes the next device once the last is dropped.
        std::thread::sleep(Duration::from_millis(50));
    };
    cycle();
    let before = open_fds();
    for _ in 0..20 {
        cycle();
    }
    let after = open_fds();
    assert!(
        after <= before + 2,
        "{before} fds open after one connection, {after} after 20 more"
    );
    server.stop();
}
