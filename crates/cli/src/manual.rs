//! `vdstream completions SHELL` and `vdstream man --out DIR`: shell completions and man
//! pages made from the command definition itself (clap_complete, clap_mangen), so they say
//! what `--help` says and cannot drift from it. The Debian package installs both
//! (packaging/build-deb).

use std::path::PathBuf;

use crate::exit::{fail, Kind};

#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  source <(vdstream completions bash)                     this shell, now
  vdstream completions bash > /usr/share/bash-completion/completions/vdstream
  vdstream completions zsh > /usr/share/zsh/vendor-completions/_vdstream
  vdstream completions fish > ~/.config/fish/completions/vdstream.fish")]
pub struct CompletionsArgs {
    /// The shell whose completion script to print on stdout: bash, zsh, fish, elvish or
    /// powershell.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  vdstream man --out man1 && man -l man1/vdstream-server.1
  vdstream man --out /usr/local/share/man/man1             then `man vdstream-target-attach`")]
pub struct ManArgs {
    /// Folder to write the pages to, one per command: vdstream.1, vdstream-server.1,
    /// vdstream-target-attach.1 and so on (made if missing; pages there are replaced).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

/// Prints the completion script for `args.shell` of the command line `cmd`.
pub fn completions(args: CompletionsArgs, mut cmd: clap::Command) -> anyhow::Result<()> {
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "vdstream", &mut script);
    out!("{}", String::from_utf8_lossy(&script));
    Ok(())
}

/// Writes a man page per command of `cmd` into `args.out`.
pub fn man(args: ManArgs, cmd: clap::Command) -> anyhow::Result<()> {
    let dir = &args.out;
    std::fs::create_dir_all(dir).map_err(|e| {
        fail(
            Kind::Io,
            format!(
                "cannot make the folder {} for the man pages: {e}",
                dir.display()
            ),
        )
    })?;
    clap_mangen::generate_to(cmd, dir).map_err(|e| {
        fail(
            Kind::Io,
            format!("cannot write the man pages into {}: {e}", dir.display()),
        )
    })?;
    let pages = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".1"))
        .count();
    outln!("vdstream: {pages} man pages in {}", dir.display());
    Ok(())
}
