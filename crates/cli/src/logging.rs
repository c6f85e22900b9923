//! The process's log: the `log` records every crate writes and `tracing` events, on stderr
//! through tracing-subscriber. RUST_LOG filters them (default `info,rustls=error`: rustls's
//! own warnings are about what a peer sent, and a client could fill the log with them;
//! failed TLS handshakes are logged by the NBD side).
//!
//! `VDSTREAM_LOG_FORMAT` chooses the lines: `text` (the default: time, level, module,
//! message), `json` (one object a line: `timestamp`, `level`, `target`, `message` and the
//! event's fields, for log shippers and `journalctl -o cat | jq`), or `journal` (text
//! without the time, which the journal adds). Under systemd (`JOURNAL_STREAM` set) the
//! default is `journal`.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Text,
    Json,
    Journal,
}

/// The format `VDSTREAM_LOG_FORMAT` asks for (unknown words: the default, with a warning
/// once the log is up).
fn format(var: Option<&str>, under_systemd: bool) -> (Format, Option<String>) {
    let default = if under_systemd {
        Format::Journal
    } else {
        Format::Text
    };
    match var.map(str::trim) {
        None | Some("") => (default, None),
        Some("text") => (Format::Text, None),
        Some("json") => (Format::Json, None),
        Some("journal") => (Format::Journal, None),
        Some(other) => (default, Some(format!("VDSTREAM_LOG_FORMAT={other:?} is not text, json or journal; logging as {default:?}"))),
    }
}

/// Whether the text log is coloured: on a terminal only, unless NO_COLOR is set
/// (no-color.org) or TERM is unset or `dumb`: a network-booted machine's init has no TERM
/// worth the name, and its serial console is kept as plain text.
fn colour(terminal: bool, no_color: Option<&std::ffi::OsStr>, term: Option<&str>) -> bool {
    terminal
        && no_color.is_none_or(|v| v.is_empty())
        && term.is_some_and(|t| !t.is_empty() && t != "dumb")
}

/// Starts the log; call once, first thing.
pub fn init() {
    let var = std::env::var("VDSTREAM_LOG_FORMAT").ok();
    let (format, warning) = format(var.as_deref(), std::env::var_os("JOURNAL_STREAM").is_some());
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,rustls=error"));
    let ansi = format == Format::Text
        && colour(
            std::io::stderr().is_terminal(),
            std::env::var_os("NO_COLOR").as_deref(),
            std::env::var("TERM").ok().as_deref(),
        );
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let _ = match format {
        Format::Text => fmt.try_init(),
        Format::Journal => fmt.without_time().try_init(),
        Format::Json => fmt.json().flatten_event(true).try_init(),
    };
    if let Some(w) = warning {
        log::warn!("{w}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_real_terminal_without_no_color() {
        use std::ffi::OsStr;
        assert!(colour(true, None, Some("xterm-256color")));
        assert!(!colour(false, None, Some("xterm")));
        assert!(!colour(true, Some(OsStr::new("1")), Some("xterm")));
        assert!(colour(true, Some(OsStr::new("")), Some("xterm")));
        assert!(!colour(true, None, None));
        assert!(!colour(true, None, Some("dumb")));
    }

    #[test]
    fn the_format_follows_the_variable_then_systemd() {
        assert_eq!(format(None, false).0, Format::Text);
        assert_eq!(format(None, true).0, Format::Journal);
        assert_eq!(format(Some("json"), true).0, Format::Json);
        assert_eq!(format(Some(" text "), true).0, Format::Text);
        let (f, warning) = format(Some("xml"), false);
        assert_eq!(f, Format::Text);
        assert!(
            warning.is_some_and(|w| w.contains("\"xml\"") && w.contains("text, json or journal"))
        );
    }
}
