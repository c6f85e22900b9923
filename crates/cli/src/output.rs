//! What the commands share: every line on stdout and stderr goes through [`outln!`],
//! [`out!`] and [`errln!`] (never `println!`, which panics on a closed pipe: clippy's
//! `print_stdout` lint is denied in main.rs); and what the store commands share: `--store
//! DIR` and `--json`, one JSON document or human lines on stdout, and progress bars on
//! stderr (only on a terminal, never with `--json`).
//!
//! A closed stdout (EPIPE: `vdstream audit | head -1`) is not an error:
//! - a command that only prints (the default) exits at once, quietly, with status 0;
//! - a service (`server`, `serve-image`, `target attach`, `demo`, `bench`: see
//!   [`keep_running_without_stdout`]) drops what it would print and goes on serving, so
//!   that its clients and its clean-up do not depend on who reads its output.
//!
//! SIGPIPE stays ignored (Rust's default) in every command: a server writing to a socket
//! whose client left must get EPIPE on that socket, not die.

use std::fmt;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use vdstream_store::{store_dir, Store};

/// Prints to stdout like `print!`, through [`write_stdout`].
macro_rules! out {
    ($($arg:tt)*) => { $crate::output::write_stdout(format_args!($($arg)*)) };
}

/// Prints a line to stdout like `println!`, through [`write_stdout`].
macro_rules! outln {
    () => { $crate::output::write_stdout(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::output::write_stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

/// Prints a line to stderr like `eprintln!`, never panicking (a closed stderr drops it).
macro_rules! errln {
    ($($arg:tt)*) => { $crate::output::write_stderr(format_args!("{}\n", format_args!($($arg)*))) };
}

/// Returns a usage error (exit status 2, kind "usage": exit.rs), like `anyhow::bail!`.
macro_rules! usage {
    ($($arg:tt)*) => { return Err($crate::exit::fail($crate::exit::Kind::Usage, format!($($arg)*))) };
}

/// Returns a conflict error (exit status 4, kind "conflict": exit.rs), like `anyhow::bail!`.
macro_rules! conflict {
    ($($arg:tt)*) => { return Err($crate::exit::fail($crate::exit::Kind::Conflict, format!($($arg)*))) };
}

/// false once a service said it outlives its stdout.
static EXIT_ON_CLOSED_STDOUT: AtomicBool = AtomicBool::new(true);

/// true once anything was written to stdout.
static WROTE_STDOUT: AtomicBool = AtomicBool::new(false);

/// The exit status when stdout cannot be written (`Kind::Io`: exit.rs builds on this file).
pub const IO_STATUS: i32 = 5;

/// Whether the command has written to stdout (a --json error object then stays off it:
/// exit.rs).
pub fn wrote_stdout() -> bool {
    WROTE_STDOUT.load(Ordering::Relaxed)
}

/// Called by the services: a closed stdout then drops their output instead of ending them.
pub fn keep_running_without_stdout() {
    EXIT_ON_CLOSED_STDOUT.store(false, Ordering::Relaxed);
}

/// Writes to stdout and flushes. A closed pipe ends a printing command quietly (status 0)
/// and is ignored by a service; another error (a full disk behind `>`) ends the command
/// with the I/O exit status.
pub fn write_stdout(args: fmt::Arguments<'_>) {
    WROTE_STDOUT.store(true, Ordering::Relaxed);
    let mut stdout = std::io::stdout().lock();
    let Err(e) = stdout.write_fmt(args).and_then(|()| stdout.flush()) else {
        return;
    };
    drop(stdout);
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        if EXIT_ON_CLOSED_STDOUT.load(Ordering::Relaxed) {
            std::process::exit(0);
        }
        return;
    }
    if EXIT_ON_CLOSED_STDOUT.load(Ordering::Relaxed) {
        write_stderr(format_args!(
            "vdstream: error: cannot write to stdout: {e}\n"
        ));
        std::process::exit(IO_STATUS);
    }
}

/// Writes to stderr, ignoring errors (there is nowhere left to report them).
pub fn write_stderr(args: fmt::Arguments<'_>) {
    let _ = std::io::stderr().lock().write_fmt(args);
}

/// Where a command on `--store s3://BUCKET/PREFIX` works: the store's metadata writer
/// (`PREFIX/writer.json`) changes it. On the writer's host the command opens the writer's
/// folder, a whole store, as it opens any store folder (its changes are published within
/// about a second); elsewhere the commands the API serves are sent to the writer's URL.
#[derive(Debug, Clone)]
pub enum S3Store {
    Local(PathBuf),
    Remote {
        url: String,
        host: String,
        location: String,
    },
}

/// Reads `writer.json` of the s3:// store `text` (once per process).
/// (Its errors are `vdstream_objstore::Error`s, which the exit status classifies.)
fn s3_store(text: &str) -> Option<Result<S3Store, vdstream_objstore::Error>> {
    use vdstream_objstore::writer::{hostname, WriterRecord};
    static RESOLVED: std::sync::OnceLock<Result<S3Store, vdstream_objstore::Error>> =
        std::sync::OnceLock::new();
    let location = vdstream_objstore::S3Location::parse(text)?;
    Some(
        RESOLVED
            .get_or_init(|| {
                let location = location?;
                let bucket = vdstream_objstore::copy::open_bucket(&location)?;
                let rec = WriterRecord::read(&bucket)?.ok_or_else(|| {
                    vdstream_objstore::Error::NotFound(format!("{location} has no metadata writer, so nothing can change it now: start one with \
                             `vdstream server --store {location} --metadata-writer --http ADDR` (or make changes in a local store and `vdstream store copy` it up)"))
                })?;
                // The writer's folder, when it is on this host: the same id in the folder
                // (a host name alone may repeat, and the bucket names the folder).
                let ours = std::fs::read_to_string(rec.folder.join("writer-id")).is_ok_and(|id| id.trim() == rec.id);
                if rec.host == hostname() && ours && rec.folder.join("store.json").exists() {
                    if !rec.alive() {
                        log::warn!("the metadata writer of {location} has not renewed {} for {} s: changes made in its folder are published once it runs", vdstream_objstore::writer::WRITER_OBJECT, rec.age());
                    }
                    return Ok(S3Store::Local(rec.folder));
                }
                Ok(S3Store::Remote { url: rec.url, host: rec.host, location: location.to_string() })
            })
            .clone(),
    )
}

/// Options every store command takes.
#[derive(Debug, Clone, Args)]
pub struct StoreOpts {
    /// Store directory, or s3://BUCKET/PREFIX (a store in object storage: on its metadata
    /// writer's host the writer's folder, elsewhere the writer's API for the commands that
    /// take --server). Default: $VDSTREAM_STORE, else /var/lib/vdstream/store.
    #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX", global = true)]
    pub store: Option<PathBuf>,

    /// Print one JSON document on stdout instead of human lines (errors too: see
    /// `vdstream --help`, "Exit status").
    #[arg(long, global = true)]
    pub json: bool,
}

impl StoreOpts {
    pub fn dir(&self) -> PathBuf {
        let dir = store_dir(self.store.as_deref());
        match dir.to_str().and_then(s3_store) {
            Some(Ok(S3Store::Local(folder))) => folder,
            _ => dir,
        }
    }

    /// For an s3:// store: where commands go (see [`S3Store`]); an error when the bucket or
    /// its writer cannot be read.
    pub fn s3(&self) -> Result<Option<S3Store>> {
        let dir = store_dir(self.store.as_deref());
        match dir.to_str().and_then(s3_store) {
            None => Ok(None),
            Some(Ok(w)) => Ok(Some(w)),
            Some(Err(e)) => Err(e.clone().into()),
        }
    }

    /// Refuses an s3:// store whose metadata writer is on another host: the command works
    /// on the store's files, which are there.
    fn local_files(&self) -> Result<()> {
        if let Some(S3Store::Remote {
            url,
            host,
            location,
        }) = self.s3()?
        {
            return Err(vdstream_objstore::Error::BadInput(format!(
                "{location} is changed by its metadata writer at {url} on {host}: this command works on the store's files, so run it on {host} \
                 (there --store {location} opens the writer's folder), or send it with --server {url} where the command takes --server"))
            .into());
        }
        Ok(())
    }

    /// Opens the existing store.
    pub fn open(&self) -> Result<Store> {
        self.local_files()?;
        Ok(Store::open(self.dir())?)
    }

    /// Opens the store, creating it if needed, and runs `f` on it; `true` when it was
    /// created (said in human output once `f` succeeded). When `f` fails, a store this call
    /// created is removed again, with the folders created for it, as long as it holds no
    /// vDisk: a failed command leaves nothing behind.
    pub fn in_new_or_existing_store<T>(
        &self,
        f: impl FnOnce(&Store) -> Result<T>,
    ) -> Result<(Store, bool, T)> {
        self.local_files()?;
        let dir = self.dir();
        let created_from = vdstream_store::first_missing_dir(&dir);
        let (store, created) = match Store::open_or_create(&dir) {
            Ok(x) => x,
            Err(e) => {
                if let Some(top) = &created_from {
                    vdstream_store::store::remove_empty_dirs(&dir, top);
                }
                return Err(e.into());
            }
        };
        match f(&store) {
            Ok(v) => {
                if created && !self.json {
                    outln!("created a new store at {}", store.root().display());
                }
                Ok((store, created, v))
            }
            Err(e) => {
                if created {
                    let root = store.root().to_path_buf();
                    match store.remove_new(created_from.as_deref()) {
                        Ok(true) => {}
                        Ok(false) => errln!("note: kept the new store at {}: another command put a vDisk in it meanwhile", root.display()),
                        Err(re) => errln!("note: could not remove the new store at {} after the failure: {re}", root.display()),
                    }
                }
                Err(e)
            }
        }
    }

    /// Prints `json` with --json, else `human`.
    pub fn emit(&self, json: serde_json::Value, human: impl FnOnce() -> String) {
        if self.json {
            outln!(
                "{}",
                serde_json::to_string_pretty(&json).expect("serializes")
            );
        } else {
            let text = human();
            if !text.is_empty() {
                outln!("{text}");
            }
        }
    }

    /// A byte progress bar for `what`, hidden unless stderr is a terminal and not --json.
    pub fn bar(&self, what: &str) -> Bar {
        let pb = if !self.json && std::io::stderr().is_terminal() {
            let pb = ProgressBar::new(0);
            pb.set_style(
                ProgressStyle::with_template(
                    "{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            pb.set_message(what.to_string());
            pb
        } else {
            ProgressBar::hidden()
        };
        Bar { pb }
    }
}

/// A progress bar fed by the store's `(done, total)` callbacks.
#[derive(Debug)]
pub struct Bar {
    pb: ProgressBar,
}

impl Bar {
    pub fn update(&self, done: u64, total: u64) {
        if self.pb.length() != Some(total) {
            self.pb.set_length(total);
        }
        self.pb.set_position(done);
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.pb.finish_and_clear();
    }
}
