//! `vdstream completions SHELL` and `vdstream man --out DIR`: shell completions and man
//! pages made from the command definition itself (clap_complete, clap_mangen), so they say
//! what `--help` says and cannot drift from it; the completions also name the store's vDisks
//! and targets (completion.rs). The Debian package installs both
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

/// Prints the completion script for `args.shell` (see completion.rs).
pub fn completions(args: CompletionsArgs) -> anyhow::Result<()> {
    let script = crate::completion::registration(args.shell)
        .map_err(|e| fail(Kind::Usage, e.to_string()))?;
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
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    write_pages(&cmd, dir).map_err(|e| {
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

/// Writes the page of `cmd` and of each of its subcommands into `dir`.
fn write_pages(cmd: &clap::Command, dir: &std::path::Path) -> std::io::Result<()> {
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        write_pages(sub, dir)?;
    }
    let man = clap_mangen::Man::new(cmd.clone());
    std::fs::write(dir.join(man.get_filename()), page(cmd, &man)?)
}

/// One man page: clap_mangen's sections, then the command's after-help blocks
/// ("Examples:", "Exit status:", ...) each as a section of its own, their lines kept as
/// written (no filling), so that examples and tables stay in their columns.
fn page(cmd: &clap::Command, man: &clap_mangen::Man) -> std::io::Result<Vec<u8>> {
    let mut w = Vec::new();
    man.render_title(&mut w)?;
    man.render_name_section(&mut w)?;
    man.render_synopsis_section(&mut w)?;
    man.render_description_section(&mut w)?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(&mut w)?;
    }
    if cmd.get_subcommands().any(|s| !s.is_hide_set()) {
        man.render_subcommands_section(&mut w)?;
    }
    if let Some(after) = cmd.get_after_long_help().or_else(|| cmd.get_after_help()) {
        w.extend_from_slice(after_help_roff(&after.to_string()).as_bytes());
    }
    if cmd.get_version().is_some() {
        man.render_version_section(&mut w)?;
    }
    Ok(w)
}

/// The roff of an after-help text: a heading (a line of at most three words at column 0
/// that ends with ':') starts a section named by it; the lines under it are printed as
/// they are (`.nf`).
pub(crate) fn after_help_roff(text: &str) -> String {
    let mut out = String::new();
    let mut open = false;
    for line in text.lines() {
        // "Examples:", "Exit status:": short, at column 0, ending with ':'.
        let heading = !line.starts_with(' ')
            && line.ends_with(':')
            && (1..=3).contains(&line.split_whitespace().count());
        if heading || !open {
            if open {
                out.push_str(".fi\n");
            }
            let name = if heading {
                line.trim_end_matches(':').to_uppercase()
            } else {
                "NOTES".to_string()
            };
            out.push_str(&format!(".SH \"{}\"\n.nf\n", name.replace('"', "")));
            open = true;
            if heading {
                continue;
            }
        }
        out.push_str(&roff_line(line));
        out.push('\n');
    }
    if open {
        out.push_str(".fi\n");
    }
    out
}

/// `line` as literal roff text: backslashes and hyphens escaped (so that `--flag` is
/// typed back as written), and a line that starts with `.` or `'` not read as a request.
fn roff_line(line: &str) -> String {
    let escaped = line.replace('\\', "\\e").replace('-', "\\-");
    if escaped.starts_with('.') || escaped.starts_with('\'') {
        format!("\\&{escaped}")
    } else {
        escaped
    }
}

#[cfg(test)]
mod tests {
    use super::after_help_roff;

    #[test]
    fn after_help_blocks_keep_their_lines() {
        let roff = after_help_roff(
            "Examples:\n  vdstream server --store /srv   serve it\n  .hidden \\ x\n\nExit status:\n  0  ok\n  2  usage",
        );
        assert_eq!(
            roff,
            ".SH \"EXAMPLES\"\n.nf\n  vdstream server \\-\\-store /srv   serve it\n  .hidden \\e x\n\n.fi\n.SH \"EXIT STATUS\"\n.nf\n  0  ok\n  2  usage\n.fi\n"
        );
        // A request-looking line is escaped; text before any heading is NOTES; a sentence
        // that ends with ':' is text, not a heading.
        assert_eq!(after_help_roff(".x"), ".SH \"NOTES\"\n.nf\n\\&.x\n.fi\n");
        assert_eq!(
            after_help_roff("Exit status:\nWith --json, a failure prints:"),
            ".SH \"EXIT STATUS\"\n.nf\nWith \\-\\-json, a failure prints:\n.fi\n"
        );
    }
}
