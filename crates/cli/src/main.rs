//! The `vdstream` binary: argument parsing and wiring only. Every capability lives in a
//! library crate; this file turns command lines into calls and errors into messages and
//! exit statuses (exit.rs). Output goes through output.rs's `outln!` (a closed stdout is not
//! a panic), hence the lints below.
#![deny(clippy::print_stdout, clippy::print_stderr)]

#[macro_use]
mod output;
mod audit;
mod bench;
mod completion;
mod demo;
#[macro_use]
mod exit;
mod initrd;
mod logging;
mod manual;
mod penalty_flags;
mod pki;
mod ram_sizing;
mod remote;
mod serve_image;
mod server;
mod size;
mod store_cmd;
mod target;
mod target_identity;
mod target_migrate;
mod target_record;
mod tls_flags;
mod token;
mod vdisk;
mod version;

use clap::{Parser, Subcommand};

/// vdstream streams one golden disk image to many machines over NBD and gives each
/// machine its own fast, throw-away write cache.
#[derive(Debug, Parser)]
#[command(name = "vdstream", version, about, long_about = None, after_help = concat!("\
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
  vdstream store copy --from /var/lib/vdstream/store --to s3://farm/site-a
                                                the store into S3-compatible object storage (Garage, MinIO, AWS)
  vdstream server --store s3://farm/site-a      serve it from there (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)
  vdstream target attach vm1 --server 'nbd+unix:///?socket=/tmp/vdstream.sock'
                                                a target's agent: local cache, socket for qemu
  vdstream size --trace vm1.trace --ram 64M,256M,1G   RAM sizing from a recorded trace (--record-trace)
  vdstream bench 'nbd+unix:///?socket=/tmp/vdstream.sock' --profile vdi
                                                the VDI profile: IOPS, MiB/s, latency
  vdstream pki init --farm lab                  a CA; then `pki issue server|target|admin NAME --out DIR`
  vdstream initrd build --vdisk golden --out initrd.img --kernel-out vmlinuz
                                                network boot: the version's kernel and an initramfs

Logging: set RUST_LOG=debug (or info, warn) for more detail, VDSTREAM_LOG_FORMAT=json for JSON lines.

", exit_status_help!()))]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    ServeImage(serve_image::ServeImageArgs),
    Server(Box<server::ServerArgs>),
    Vdisk(vdisk::VdiskArgs),
    Version(version::VersionArgs),
    Audit(audit::AuditArgs),
    Store(store_cmd::StoreArgs),
    Target(target::TargetArgs),
    Token(token::TokenArgs),
    Size(ram_sizing::SizeArgs),
    Demo(demo::DemoArgs),
    Bench(bench::BenchArgs),
    Pki(pki::PkiArgs),
    Initrd(initrd::InitrdArgs),
    /// Print the shell completion script for bash, zsh, fish, elvish or powershell
    Completions(manual::CompletionsArgs),
    /// Write the man pages, one per command (vdstream.1, vdstream-server.1, ...), into a folder
    Man(manual::ManArgs),
}

fn main() {
    completion::answer_if_asked(<Cli as clap::CommandFactory>::command);
    logging::init();
    let json = exit::json_requested();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version, and usage errors without --json: clap prints (ignoring a
        // closed stdout) and exits 0 or 2.
        Err(e) if !json || !e.use_stderr() => e.exit(),
        Err(e) => {
            let text = e.render().to_string();
            let message = text.trim().trim_start_matches("error: ").to_string();
            exit::exit_with(&exit::fail(exit::Kind::Usage, message), true)
        }
    };
    // The services outlive a closed stdout (they serve sockets and clean up after
    // themselves); every other command is a printer and ends quietly on one. output.rs.
    let service = match &cli.command {
        Command::ServeImage(_) | Command::Server(_) | Command::Demo(_) | Command::Bench(_) => true,
        Command::Target(t) => t.is_attach(),
        _ => false,
    };
    if service {
        output::keep_running_without_stdout();
    }
    let result = match cli.command {
        Command::ServeImage(args) => serve_image::run(args),
        Command::Server(args) => server::run(*args),
        Command::Vdisk(args) => vdisk::run(args),
        Command::Version(args) => version::run(args),
        Command::Audit(args) => audit::run(args),
        Command::Store(args) => store_cmd::run(args),
        Command::Target(args) => target::run(args),
        Command::Token(args) => token::run(args),
        Command::Size(args) => ram_sizing::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Pki(args) => pki::run(args),
        Command::Initrd(args) => initrd::run(args),
        Command::Completions(args) => manual::completions(args),
        Command::Man(args) => manual::man(args, <Cli as clap::CommandFactory>::command()),
    };
    if let Err(err) = result {
        exit::exit_with(&err, json);
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
            let cli = parse(&[
                "serve-image",
                "b.img",
                "--cache",
                "device-disk",
                "--intermediate-buffering",
                word,
            ])
            .unwrap();
            let Command::ServeImage(args) = cli.command else {
                panic!("serve-image")
            };
            assert_eq!(
                args.intermediate_buffering(),
                want,
                "--intermediate-buffering {word}"
            );
        }
        assert!(parse(&[
            "serve-image",
            "b.img",
            "--cache",
            "device-disk",
            "--intermediate-buffering",
            "maybe"
        ])
        .is_err());
    }

    #[test]
    fn io_engine_defaults_to_sync_and_takes_io_uring() {
        use vdstream_blockdev::IoEngineKind;
        let Command::ServeImage(args) = parse(&["serve-image", "b.img", "--cache", "device-disk"])
            .unwrap()
            .command
        else {
            panic!("serve-image")
        };
        assert_eq!(args.io_engine(), IoEngineKind::Sync);
        let Command::ServeImage(args) = parse(&[
            "serve-image",
            "b.img",
            "--cache",
            "device-disk",
            "--io-engine",
            "io_uring",
        ])
        .unwrap()
        .command
        else {
            panic!("serve-image")
        };
        assert_eq!(args.io_engine(), IoEngineKind::IoUring);
        assert!(parse(&[
            "serve-image",
            "b.img",
            "--cache",
            "device-disk",
            "--io-engine",
            "aio"
        ])
        .is_err());
        assert!(parse(&["serve-image", "b.img", "--threads", "0"]).is_err());
    }

    #[test]
    fn cache_type_names_are_checked() {
        let err = parse(&["serve-image", "b.img", "--cache", "ram"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("ram-overflow"),
            "the error lists the valid types: {err}"
        );
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    /// Every argument and subcommand of every command says what it is (`--help` teaches).
    #[test]
    fn every_argument_has_help() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                let id = a.get_id().as_str();
                if a.is_hide_set() || id == "help" || id == "version" {
                    continue;
                }
                let help = a
                    .get_help()
                    .or(a.get_long_help())
                    .map(|h| h.to_string())
                    .unwrap_or_default();
                if help.trim().is_empty() {
                    missing.push(format!("{path}: {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                let name = format!("{path} {}", sub.get_name());
                if sub
                    .get_about()
                    .or(sub.get_long_about())
                    .is_none_or(|h| h.to_string().trim().is_empty())
                {
                    missing.push(format!("{name} (the command itself)"));
                }
                walk(sub, &name, missing);
            }
        }
        use clap::CommandFactory;
        let mut missing = Vec::new();
        walk(&Cli::command(), "vdstream", &mut missing);
        assert!(
            missing.is_empty(),
            "arguments without help text:\n  {}",
            missing.join("\n  ")
        );
    }

    /// `server --help` shows its export table as lines, not one paragraph.
    #[test]
    fn server_help_keeps_the_export_table() {
        use clap::CommandFactory;
        let mut cmd = Cli::command();
        let help = cmd
            .find_subcommand_mut("server")
            .expect("server")
            .render_long_help()
            .to_string();
        let lines: Vec<&str> = help.lines().map(str::trim).collect();
        for export in [
            "vdisk/NAME ",
            "vdisk/NAME@V ",
            "maintenance/NAME ",
            "target/ID ",
        ] {
            assert!(
                lines.iter().any(|l| l.starts_with(export)),
                "a line starts with {export:?}:\n{help}"
            );
        }
    }
}
