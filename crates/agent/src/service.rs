//! `target attach` as a service: in the foreground until SIGINT or SIGTERM, or with
//! `--daemon` as the background process behind a kernel NBD device (see [`daemon`]).
//!
//! In the foreground the first signal stops the agent the orderly way (requests in flight
//! finished, then the last flush), which waits for a server as long as any request does
//! (`--retry-for`); a second signal is the way out when none will come back: the process
//! leaves at once (exit status 1), removing its sockets. The daemon takes no signal; the
//! kernel disconnecting its device, or `vdstream target detach`, stops it.

use std::path::PathBuf;
use std::process::ExitStatus;

use vdstream_nbd::server::ShutdownSignal;

use crate::daemon::{self, Started};
use crate::{Agent, AgentError};

/// How `target attach` runs its agent.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// The target's id.
    pub id: String,
    /// `--daemon`: the command starts the agent in the background and returns once its
    /// device is up.
    pub daemon: bool,
    /// `--kernel-nbd`: the process serves a kernel block device (it is marked an I/O flusher).
    pub kernel_nbd: bool,
}

/// How a [`run`] ended.
#[derive(Debug)]
pub enum Outcome {
    /// `--daemon`, in the command: the daemon (this pid) is ready and goes on alone.
    DaemonReady { pid: u32 },
    /// `--daemon`, in the command: the daemon ended before its device was up (it has
    /// printed why), with this status.
    DaemonEnded(ExitStatus),
    /// The agent served until it was stopped (boxed: an agent is large beside a pid).
    Served(Box<Agent>),
}

/// Runs the agent that `open` opens: as the daemon or the command that starts it
/// (`--daemon`), or in the foreground until a signal. `open` runs after the process has
/// become what it will be (the daemon's signals and memory lock are set before any thread
/// starts) and before anything is served.
pub fn run<E: From<AgentError>>(
    config: &ServiceConfig,
    open: impl FnOnce() -> Result<Agent, E>,
) -> Result<Outcome, E> {
    // --daemon: the command starts the daemon and waits for it; the daemon itself runs the
    // agent, told so by the environment.
    let ready = match (
        config.daemon,
        config.daemon.then(daemon::ready_fd).flatten(),
    ) {
        (true, None) => {
            return Ok(match daemon::start()? {
                Started::Ready { pid } => Outcome::DaemonReady { pid },
                Started::Ended(status) => Outcome::DaemonEnded(status),
            })
        }
        (true, Some(fd)) => {
            daemon::become_daemon(&config.id);
            Some(fd)
        }
        (false, _) => None,
    };
    if config.kernel_nbd {
        daemon::io_flusher(&config.id);
    }
    let mut agent = open()?;
    if let Some(fd) = ready {
        daemon::report_ready(fd);
    }
    serve(&mut agent, config.daemon)?;
    Ok(Outcome::Served(Box::new(agent)))
}

/// Serves until the agent stops: the daemon until its device goes, otherwise until a
/// signal (a second one leaves at once).
fn serve(agent: &mut Agent, daemon: bool) -> Result<(), AgentError> {
    let c = agent.config();
    let sockets: Vec<PathBuf> = c
        .serve_socket
        .then(|| c.socket.clone())
        .into_iter()
        .chain(c.vhost_user.clone())
        .collect();
    // The agent's one runtime: its remote base's connections run on it already.
    crate::remote::runtime()?.block_on(async {
        let (trigger, shutdown) = ShutdownSignal::new();
        if daemon {
            // No signal stops the daemon: the kernel disconnecting its device does.
            let served = agent.serve(shutdown).await;
            drop(trigger);
            return served;
        }
        let signals = tokio::spawn(async move {
            if let Err(e) = wait_for_signal().await {
                log::error!("{e}");
                return;
            }
            log::info!("shutting down: finishing requests in flight, then the last flush (a second SIGINT or SIGTERM leaves without it)");
            trigger.shutdown();
            // The last flush waits for a server as long as any request does (--retry-for);
            // a second signal is the way out when none will come back.
            if wait_for_signal().await.is_ok() {
                log::error!(
                    "a second signal: leaving now, without waiting for the requests in flight and the last flush; \
                     what the server answered since the guest's last flush may not be durable"
                );
                for socket in &sockets {
                    let _ = std::fs::remove_file(socket);
                }
                std::process::exit(1);
            }
        });
        let served = agent.serve(shutdown).await;
        signals.abort();
        served
    })
}

/// Waits for SIGINT or SIGTERM.
pub async fn wait_for_signal() -> Result<(), AgentError> {
    use tokio::signal::unix::{signal, SignalKind};
    let handler = |kind: SignalKind, what: &str| {
        signal(kind).map_err(|err| AgentError::Io {
            what: format!("cannot install the {what} handler"),
            err,
        })
    };
    let mut term = handler(SignalKind::terminate(), "SIGTERM")?;
    let mut int = handler(SignalKind::interrupt(), "SIGINT")?;
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
    Ok(())
}
