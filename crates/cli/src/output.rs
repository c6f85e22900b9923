//! What the store commands share: `--store DIR` and `--json`, one JSON document or human
//! lines on stdout, and progress bars on stderr (only on a terminal, never with `--json`).

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use vdstream_store::{store_dir, Store};

/// Options every store command takes.
#[derive(Debug, Clone, Args)]
pub struct StoreOpts {
    /// Store directory. Default: $VDSTREAM_STORE, else /var/lib/vdstream/store.
    #[arg(long, value_name = "DIR", global = true)]
    pub store: Option<PathBuf>,

    /// Print one JSON document on stdout instead of human lines.
    #[arg(long, global = true)]
    pub json: bool,
}

impl StoreOpts {
    pub fn dir(&self) -> PathBuf {
        store_dir(self.store.as_deref())
    }

    /// Opens the existing store.
    pub fn open(&self) -> Result<Store> {
        Ok(Store::open(self.dir())?)
    }

    /// Opens the store, creating it if needed (and saying so in human output).
    pub fn open_or_create(&self) -> Result<(Store, bool)> {
        let (store, created) = Store::open_or_create(self.dir())?;
        if created && !self.json {
            println!("created a new store at {}", store.root().display());
        }
        Ok((store, created))
    }

    /// Prints `json` with --json, else `human`.
    pub fn emit(&self, json: serde_json::Value, human: impl FnOnce() -> String) {
        if self.json {
            println!("{}", serde_json::to_string_pretty(&json).expect("serializes"));
        } else {
            let text = human();
            if !text.is_empty() {
                println!("{text}");
            }
        }
    }

    /// A byte progress bar for `what`, hidden unless stderr is a terminal and not --json.
    pub fn bar(&self, what: &str) -> Bar {
        let pb = if !self.json && std::io::stderr().is_terminal() {
            let pb = ProgressBar::new(0);
            pb.set_style(
                ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}")
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
