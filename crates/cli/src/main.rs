//! The `vdstream` binary: argument parsing and wiring only. Every capability lives in a
//! library crate; this file turns command lines into calls and errors into messages.

mod audit;
mod bench;
mod demo;
mod output;
mod ram_sizing;
mod remote;
mod serve_image;
mod server;
mod size;
mod target;
mod target_record;
mod vdisk;
mod version;

use clap::{Parser, Subcommand};

/// vdstream streams one golden disk image to many machines over NBD and gives each
/// machine its own fast, throw-away write cache.
#[derive(Debug, Parser)]
#[command(name = "vdstream", version, about, long_about = None, after_help = "\
Examples:
  vdstream demo                                 compare the write-cache types on a demo vDisk (2 min)
  vdstream serve-image --memory 1G              a 1 GiB RAM disk on /tmp/vdstream.sock
  vdstream serve-image disk.img --read-only     a raw image, read-only
  nbdinfo 'nbd+unix:///?socket=/tmp/vdstream.sock'
  qemu-img info 'nbd+unix:///?socket=/tmp/vdstream.sock'
  vdstream vdisk create win11 --size 64G        a vDisk in the store
  vdstream version new win11                    a maintenance version to update it
  vdstream serve-image --vdisk win11            serve what production targets boot
  vdstream server --socket /run/vds.sock        serve the whole store: vdisk/NAME[@V], maintenance/NAME
  vdstream target attach vm1 --server 'nbd+unix:///?socket=/tmp/vdstream.sock'
                                                a target's agent: local cache, socket for qemu
  vdstream size --trace vm1.trace --ram 64M,256M,1G   RAM sizing from a recorded trace (--record-trace)
  vdstream bench 'nbd+unix:///?socket=/tmp/vdstream.sock' --profile vdi
                                                the VDI profile: IOPS, MiB/s, latency

Logging: set RUST_LOG=debug (or info, warn) for more detail.")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    ServeImage(serve_image::ServeImageArgs),
    Server(server::ServerArgs),
    Vdisk(vdisk::VdiskArgs),
    Version(version::VersionArgs),
    Audit(audit::AuditArgs),
    Target(target::TargetArgs),
    Size(ram_sizing::SizeArgs),
    Demo(demo::DemoArgs),
    Bench(bench::BenchArgs),
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_timestamp_millis()
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::ServeImage(args) => serve_image::run(args),
        Command::Server(args) => server::run(args),
        Command::Vdisk(args) => vdisk::run(args),
        Command::Version(args) => version::run(args),
        Command::Audit(args) => audit::run(args),
        Command::Target(args) => target::run(args),
        Command::Size(args) => ram_sizing::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => bench::run(args),
    };
    if let Err(err) = result {
        eprintln!("vdstream: error: {err:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("vdstream").chain(args.iter().copied()))
    }

    #[test]
    fn intermediate_buffering_takes_on_and_off() {
        for (word, want) in [("on", true), ("off", false)] {
            let cli = parse(&["serve-image", "b.img", "--cache", "device-disk", "--intermediate-buffering", word]).unwrap();
            let Command::ServeImage(args) = cli.command else { panic!("serve-image") };
            assert_eq!(args.intermediate_buffering(), want, "--intermediate-buffering {word}");
        }
        assert!(parse(&["serve-image", "b.img", "--cache", "device-disk", "--intermediate-buffering", "maybe"]).is_err());
    }

    #[test]
    fn io_engine_defaults_to_sync_and_takes_io_uring() {
        use vdstream_blockdev::IoEngineKind;
        let Command::ServeImage(args) = parse(&["serve-image", "b.img", "--cache", "device-disk"]).unwrap().command else { panic!("serve-image") };
        assert_eq!(args.io_engine(), IoEngineKind::Sync);
        let Command::ServeImage(args) = parse(&["serve-image", "b.img", "--cache", "device-disk", "--io-engine", "io_uring"]).unwrap().command else { panic!("serve-image") };
        assert_eq!(args.io_engine(), IoEngineKind::IoUring);
        assert!(parse(&["serve-image", "b.img", "--cache", "device-disk", "--io-engine", "aio"]).is_err());
        assert!(parse(&["serve-image", "b.img", "--threads", "0"]).is_err());
    }

    #[test]
    fn cache_type_names_are_checked() {
        let err = parse(&["serve-image", "b.img", "--cache", "ram"]).unwrap_err().to_string();
        assert!(err.contains("ram-overflow"), "the error lists the valid types: {err}");
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
