//! Load generator for the NBD client: `tasks × depth` concurrent 4 KiB random requests on
//! one connection for a fixed time, then IOPS and throughput.
//!
//! Usage: `client_bench URI [tasks=4] [depth=16] [secs=5] [rw=randread|randwrite|randrw]
//! [bs=4096] [writer=coalescing|locked]`, e.g.
//! `cargo run --release -p vdstream-nbd --example client_bench -- 'nbd+unix:///?socket=/tmp/s' rw=randrw`.
//! `randrw` is 70 % reads. The first `span` bytes of the export are used (default: all).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vdstream_nbd::client::{Client, ConnectOptions, WriterMode};

struct Args {
    uri: String,
    tasks: u64,
    depth: u64,
    secs: u64,
    rw: String,
    bs: u32,
    writer: WriterMode,
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let uri = it.next().ok_or("usage: client_bench URI [key=value...]")?;
    let mut a = Args {
        uri,
        tasks: 4,
        depth: 16,
        secs: 5,
        rw: "randread".into(),
        bs: 4096,
        writer: WriterMode::Coalescing,
    };
    for kv in it {
        let (k, v) = kv
            .split_once('=')
            .ok_or(format!("expected key=value, got {kv}"))?;
        let num = || v.parse::<u64>().map_err(|e| format!("{k}: {e}"));
        match k {
            "tasks" => a.tasks = num()?,
            "depth" => a.depth = num()?,
            "secs" => a.secs = num()?,
            "bs" => a.bs = num()? as u32,
            "rw" => a.rw = v.to_string(),
            "writer" => {
                a.writer = match v {
                    "coalescing" => WriterMode::Coalescing,
                    "locked" => WriterMode::Locked,
                    _ => return Err(format!("unknown writer {v}")),
                }
            }
            _ => return Err(format!("unknown key {k}")),
        }
    }
    Ok(a)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = parse()?;
    let opts = ConnectOptions {
        writer: a.writer,
        ..Default::default()
    };
    let client = Arc::new(Client::connect_uri(&a.uri, opts).await?);
    let blocks = client.size() / u64::from(a.bs);
    let read_percent = match a.rw.as_str() {
        "randread" => 100,
        "randwrite" => 0,
        "randrw" => 70,
        other => return Err(format!("unknown rw {other}").into()),
    };
    let ops = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(a.secs);
    let start = Instant::now();
    let mut workers = Vec::new();
    for w in 0..a.tasks * a.depth {
        let (client, ops, bs) = (client.clone(), ops.clone(), a.bs);
        workers.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(w + 1);
            let data = vec![0x5au8; bs as usize];
            let mut buf = vec![0u8; bs as usize];
            let mut n = 0u64;
            while Instant::now() < deadline {
                let offset = rng.u64(..blocks) * u64::from(bs);
                if rng.u64(..100) < read_percent {
                    buf = client.read_buf(offset, buf).await?;
                } else {
                    client.write(offset, &data, false).await?;
                }
                n += 1;
            }
            ops.fetch_add(n, Ordering::Relaxed);
            Ok::<_, vdstream_nbd::client::ClientError>(())
        }));
    }
    for w in workers {
        w.await??;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let total = ops.load(Ordering::Relaxed);
    let iops = total as f64 / elapsed;
    println!(
        "{} bs={} tasks={} depth={} writer={:?}: {:.0} IOPS, {:.1} MiB/s ({} ops in {:.2} s)",
        a.rw,
        a.bs,
        a.tasks,
        a.depth,
        a.writer,
        iops,
        iops * f64::from(a.bs) / (1024.0 * 1024.0),
        total,
        elapsed
    );
    client.disconnect().await?;
    Ok(())
}
