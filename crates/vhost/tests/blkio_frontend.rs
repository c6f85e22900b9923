//! The backend driven by a real vhost-user frontend: libblkio's `virtio-blk-vhost-user`
//! driver (the `blkio` crate, libblkio's own Rust core). It negotiates what qemu does
//! (features, CONFIG, MQ, memory slots, EVENT_IDX) and builds chains the way a driver does.

use std::mem::MaybeUninit;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::Arc;

use blkio::{Blkio, Completion, ReqFlags};
use vdstream_blockdev::{BlockDev, MemoryDev};
use vdstream_vhost::{Options, VhostServer};

fn serve(dir: &Path, dev: Arc<dyn BlockDev>, opts: Options) -> (VhostServer, std::path::PathBuf) {
    let path = dir.join("disk.vhost");
    let listener = UnixListener::bind(&path).unwrap();
    (
        VhostServer::start(listener, &path, dev, opts, "test").unwrap(),
        path,
    )
}

struct Frontend {
    b: Blkio,
    queues: Vec<blkio::Blkioq>,
    region: blkio::MemoryRegion,
}

impl Frontend {
    fn connect(path: &Path, queues: i32) -> Frontend {
        let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
        b.set_str("path", path.to_str().unwrap()).unwrap();
        b.connect()
            .unwrap_or_else(|e| panic!("connect: {}", e.message()));
        b.set_i32("num-queues", queues).unwrap();
        let out = b
            .start()
            .unwrap_or_else(|e| panic!("start: {}", e.message()));
        let region = b.alloc_mem_region(4 << 20).unwrap();
        b.map_mem_region(&region).unwrap();
        Frontend {
            b,
            queues: out.queues,
            region,
        }
    }

    fn buf(&mut self) -> &mut [u8] {
        // SAFETY: the region is 4 MiB of memory mapped for the life of `b`, used by one test
        // thread at a time between requests.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, self.region.len) }
    }

    /// Waits for one completion on queue `q`; its result.
    fn wait(&mut self, q: usize) -> i32 {
        let mut c = [MaybeUninit::<Completion>::uninit()];
        let n = self.queues[q].do_io(&mut c, 1, None, None).unwrap();
        assert_eq!(n, 1);
        // SAFETY: do_io filled one completion.
        unsafe { c[0].assume_init_read() }.ret
    }

    fn write(&mut self, q: usize, at: u64, len: usize) -> i32 {
        let p = self.region.addr as *const u8;
        self.queues[q].write(at, p, len, 0, ReqFlags::empty());
        self.wait(q)
    }

    fn read(&mut self, q: usize, at: u64, len: usize) -> i32 {
        let p = self.region.addr as *mut u8;
        self.queues[q].read(at, p, len, 0, ReqFlags::empty());
        self.wait(q)
    }
}

#[test]
fn a_real_frontend_writes_reads_flushes_discards_and_zeroes_on_every_queue() {
    let dir = tempfile::tempdir().unwrap();
    let dev = Arc::new(MemoryDev::new(64 << 20));
    let (mut server, path) = serve(
        dir.path(),
        dev.clone(),
        Options {
            queues: 4,
            threads: 2,
            ..Options::default()
        },
    );
    let mut f = Frontend::connect(&path, 4);
    assert_eq!(f.b.get_u64("capacity").unwrap(), 64 << 20);
    assert!(!f.b.get_bool("read-only").unwrap());
    assert_eq!(f.queues.len(), 4);
    for q in 0..4 {
        let at = q as u64 * (1 << 20);
        for (i, b) in f.buf()[..65536].iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(13).wrapping_add(q as u8);
        }
        assert_eq!(f.write(q, at, 65536), 0, "write on queue {q}");
    }
    f.queues[0].flush(0, ReqFlags::empty());
    assert_eq!(f.wait(0), 0, "flush");
    // What the frontend wrote is on the device, and reads back through another queue.
    let mut direct = vec![0u8; 65536];
    dev.read_at(&mut direct, 2 << 20).unwrap();
    assert!(direct
        .iter()
        .enumerate()
        .all(|(i, b)| *b == (i as u8).wrapping_mul(13).wrapping_add(2)));
    assert_eq!(f.read(3, 2 << 20, 65536), 0);
    assert_eq!(&f.buf()[..65536], &direct[..]);
    // Discard and write-zeroes reach the device.
    f.queues[1].discard(0, 4096, 0, ReqFlags::empty());
    assert_eq!(f.wait(1), 0, "discard");
    f.queues[1].write_zeroes(1 << 20, 8192, 0, ReqFlags::empty());
    assert_eq!(f.wait(1), 0, "write-zeroes");
    dev.read_at(&mut direct[..8192], 1 << 20).unwrap();
    assert!(direct[..8192].iter().all(|b| *b == 0));
    dev.read_at(&mut direct[..4096], 0).unwrap();
    assert!(direct[..4096].iter().all(|b| *b == 0));
    // Out of range: an error for that request, and the queue goes on.
    assert!(
        f.read(0, (64 << 20) - 4096, 8192) < 0,
        "a read past the end fails"
    );
    assert_eq!(f.read(0, 0, 4096), 0);
    let figures = server.figures();
    assert!(figures.connected);
    assert_eq!(
        (figures.requests, figures.malformed, figures.errors),
        (10, 1, 0),
        "the read past the end is the one bad request: {figures:?}"
    );
    drop(f);
    server.stop();
    assert!(!path.exists(), "the socket is removed at stop");
}

#[test]
fn a_frontend_that_reconnects_finds_the_disk_as_it_left_it() {
    let dir = tempfile::tempdir().unwrap();
    let dev = Arc::new(MemoryDev::new(16 << 20));
    let (mut server, path) = serve(
        dir.path(),
        dev,
        Options {
            queues: 2,
            threads: 2,
            ..Options::default()
        },
    );
    for round in 0..3u8 {
        let mut f = Frontend::connect(&path, 2);
        if round > 0 {
            assert_eq!(f.read(1, 4096, 4096), 0);
            assert!(
                f.buf()[..4096].iter().all(|b| *b == round - 1),
                "round {round} reads what round {} wrote",
                round - 1
            );
        }
        f.buf()[..4096].fill(round);
        assert_eq!(f.write(0, 4096, 4096), 0);
        drop(f);
    }
    // The daemon notices each disconnect; wait (bounded) for the last.
    for _ in 0..100 {
        if !server.figures().connected {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let figures = server.figures();
    assert_eq!(figures.connections, 3);
    assert!(!figures.connected);
    server.stop();
    assert_eq!(
        server.figures().connections,
        3,
        "stop's own wake-up is not counted as a frontend"
    );
}

#[test]
fn a_read_only_disk_is_offered_read_only() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, path) = serve(
        dir.path(),
        Arc::new(MemoryDev::new(1 << 20)),
        Options {
            read_only: true,
            ..Options::default()
        },
    );
    // libblkio refuses to start a read-only device as writable: the device says it is.
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", path.to_str().unwrap()).unwrap();
    b.connect().unwrap();
    let e = b
        .start()
        .err()
        .expect("a writable start of a read-only disk is refused");
    assert!(e.message().contains("read-only"), "{}", e.message());
    drop(b);
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", path.to_str().unwrap()).unwrap();
    b.set_bool("read-only", true).unwrap();
    b.connect().unwrap();
    let out = b.start().unwrap();
    let region = b.alloc_mem_region(1 << 20).unwrap();
    b.map_mem_region(&region).unwrap();
    let mut f = Frontend {
        b,
        queues: out.queues,
        region,
    };
    assert_eq!(f.read(0, 0, 4096), 0, "reads work");
    drop(f);
    server.stop();
}

#[test]
fn the_block_size_is_the_one_given() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, path) = serve(
        dir.path(),
        Arc::new(MemoryDev::new(1 << 20)),
        Options {
            logical_block: 4096,
            ..Options::default()
        },
    );
    let f = Frontend::connect(&path, 1);
    assert_eq!(f.b.get_i32("request-alignment").unwrap(), 4096);
    drop(f);
    server.stop();
}
