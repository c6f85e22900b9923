//! Authorization through the real NBD server on a unix socket: a client speaking as a
//! given identity (the TLS handshake's job once certificates are configured; here a thin
//! `Exports` wrapper sets it, since without TLS every client is `local`) is refused what
//! the policy denies with `NBD_REP_ERR_POLICY` naming the rule, each refusal leaves a line
//! in the store's audit trail, and `NBD_OPT_LIST` (read by nbdinfo) shows only what the
//! identity may open.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use vdstream_blockdev::BlockDev;
use vdstream_contract::Identity;
use vdstream_nbd::client::{Client, ClientError, ConnectOptions};
use vdstream_nbd::proto;
use vdstream_nbd::server::{ExportInfo, Exports, OpenError, OpenRequest, OpenedExport};
use vdstream_server::exports::StoreExports;
use vdstream_server::policy::AnonymousGrant;
use vdstream_server::{ServerOptions, ServerState};
use vdstream_store::audit::{self, AuditEntry};
use vdstream_store::vdisk::NewVdisk;
use vdstream_store::{NewTarget, Store};

/// The store's exports as seen by a client that is `who`.
struct As {
    inner: StoreExports,
    who: Identity,
}

impl Exports for As {
    fn list(&self) -> Vec<ExportInfo> {
        self.inner.list_for(&self.who)
    }

    fn list_for(&self, _: &Identity) -> Vec<ExportInfo> {
        self.inner.list_for(&self.who)
    }

    fn open(&self, name: &str) -> Result<Arc<dyn BlockDev>, OpenError> {
        self.inner.open(name)
    }

    fn open_export(&self, req: &OpenRequest<'_>) -> Result<OpenedExport, OpenError> {
        self.inner.open_export(&OpenRequest {
            client: &self.who,
            ..*req
        })
    }
}

struct Farm {
    dir: tempfile::TempDir,
    store: Store,
    rt: tokio::runtime::Runtime,
}

/// A store with vDisks `win` and `lin`, target `a` on win and `b` on lin.
fn farm() -> Farm {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open_or_create(dir.path().join("store")).unwrap();
    store
        .create_vdisk("win", 4 << 20, NewVdisk::default())
        .unwrap();
    store
        .create_vdisk("lin", 4 << 20, NewVdisk::default())
        .unwrap();
    for (id, vdisk) in [("a", "win"), ("b", "lin")] {
        let t = NewTarget {
            id: id.into(),
            vdisk: vdisk.into(),
            cache: "device-disk".into(),
            version: None,
            ram: None,
            overflow_max: None,
            description: None,
            macs: vec![],
            hostname: None,
            overflow_device: None,
        };
        store.add_target(t).unwrap();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    Farm { dir, store, rt }
}

impl Farm {
    /// Serves the store to clients that are `who`, on a fresh unix socket.
    fn serve(&self, who: Identity, anonymous: AnonymousGrant) -> PathBuf {
        let socket = self.dir.path().join(format!(
            "{}-{anonymous}.sock",
            who.to_string().replace(':', "-")
        ));
        let state = ServerState::new(&ServerOptions {
            socket: Some(socket.clone()),
            name: Some("pvs1".into()),
            anonymous,
            ..ServerOptions::new(self.store.root())
        });
        common::serve_exports(
            &self.rt,
            Arc::new(As {
                inner: StoreExports::new(state).unwrap(),
                who,
            }),
            &socket,
        );
        socket
    }

    fn connect(&self, socket: &Path, export: &str) -> Result<Client, ClientError> {
        let uri = format!("nbd+unix:///{export}?socket={}", socket.display());
        self.rt
            .block_on(Client::connect_uri(&uri, ConnectOptions::default()))
    }

    fn refusals(&self) -> Vec<AuditEntry> {
        let all = audit::read(&self.store.audit_path(), None, None).unwrap();
        all.into_iter()
            .filter(|e| e.action == vdstream_server::refusal::REFUSED_ACTION)
            .collect()
    }
}

/// The server's refusal of `export`: its reply type and message.
fn refused(r: Result<Client, ClientError>) -> (u32, String) {
    match r {
        Err(ClientError::Refused { reply, message, .. }) => (reply, message),
        Err(e) => panic!("expected a refusal, got {e}"),
        Ok(_) => panic!("expected a refusal, the export opened"),
    }
}

/// The export names `nbdinfo --list` shows.
fn listed(socket: &Path) -> Vec<String> {
    let out = Command::new("nbdinfo")
        .args(["--list", "--json"])
        .arg(format!("nbd+unix://?socket={}", socket.display()))
        .output()
        .expect("nbdinfo runs");
    assert!(
        out.status.success(),
        "nbdinfo --list: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut names: Vec<String> = doc["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["export-name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

#[test]
fn a_target_is_refused_other_targets_and_maintenance_with_the_rule_and_an_audit_line() {
    let f = farm();
    let sock = f.serve(Identity::Target("a".into()), AnonymousGrant::None);

    // What it may open opens.
    f.connect(&sock, "target/a").unwrap();
    f.connect(&sock, "vdisk/win").unwrap();
    f.connect(&sock, "vdisk/win@base").unwrap();
    assert!(f.refusals().is_empty());

    let (reply, message) = refused(f.connect(&sock, "target/b"));
    assert_eq!(reply, proto::REP_ERR_POLICY);
    assert_eq!(
        message,
        "refused by policy: rule target-own-exports: target:a may open only target/a and vdisk/win[@V] (its record); \
         refused target/b: connect with that target's own certificate"
    );
    let (reply, message) = refused(f.connect(&sock, "maintenance/win"));
    assert_eq!(reply, proto::REP_ERR_POLICY);
    assert!(message.starts_with("refused by policy: rule maintenance-needs-admin: target:a may not open maintenance/win"), "{message}");
    let (reply, message) = refused(f.connect(&sock, "vdisk/lin@base"));
    assert_eq!(reply, proto::REP_ERR_POLICY);
    assert!(message.contains("target-own-exports"), "{message}");
    // A target that does not exist is refused the same way: its existence is not told.
    let (reply, message) = refused(f.connect(&sock, "target/nobody"));
    assert_eq!(
        (reply, message.contains("refused target/nobody")),
        (proto::REP_ERR_POLICY, true),
        "{message}"
    );

    let lines = f.refusals();
    let seen: Vec<(&str, &str, &str, &str)> = lines
        .iter()
        .map(|e| {
            (
                e.details["identity"].as_str().unwrap(),
                e.details["export"].as_str().unwrap(),
                e.details["rule"].as_str().unwrap(),
                e.vdisk.as_str(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("target:a", "target/b", "target-own-exports", "lin"),
            (
                "target:a",
                "maintenance/win",
                "maintenance-needs-admin",
                "win"
            ),
            ("target:a", "vdisk/lin@base", "target-own-exports", "lin"),
            ("target:a", "target/nobody", "target-own-exports", ""),
        ]
    );
    assert!(
        lines
            .iter()
            .all(|e| e.details["peer"] == "unix" && e.details["option"] == "go"),
        "{lines:?}"
    );

    // LIST shows only its own vDisk.
    assert_eq!(listed(&sock), ["vdisk/win"]);
}

#[test]
fn an_attach_secret_never_reaches_the_refusal_or_the_trail() {
    let f = farm();
    let sock = f.serve(Identity::Target("a".into()), AnonymousGrant::None);
    let (_, message) = refused(f.connect(&sock, "target/b@k1+journal#00ff00ff"));
    assert!(!message.contains("00ff00ff"), "{message}");
    let text = std::fs::read_to_string(f.store.audit_path()).unwrap();
    assert!(
        text.contains("target/b@k1+journal") && !text.contains("00ff00ff"),
        "{text}"
    );
}

#[test]
fn anonymous_clients_get_what_the_grant_says_and_list_shows_the_same() {
    let f = farm();
    let none = f.serve(Identity::Anonymous, AnonymousGrant::None);
    let (reply, message) = refused(f.connect(&none, "vdisk/win"));
    assert_eq!(reply, proto::REP_ERR_POLICY);
    assert!(
        message.starts_with("refused by policy: rule anonymous-none: "),
        "{message}"
    );
    assert_eq!(listed(&none), Vec::<String>::new());

    let vdisks = f.serve(Identity::Anonymous, AnonymousGrant::Vdisks);
    f.connect(&vdisks, "vdisk/lin").unwrap();
    let (_, message) = refused(f.connect(&vdisks, "target/a"));
    assert!(
        message.starts_with("refused by policy: rule anonymous-vdisks: "),
        "{message}"
    );
    assert_eq!(listed(&vdisks), ["vdisk/lin", "vdisk/win"]);

    let all = f.serve(Identity::Anonymous, AnonymousGrant::All);
    f.connect(&all, "target/b").unwrap();
    let (_, message) = refused(f.connect(&all, "maintenance/lin"));
    assert!(
        message
            .starts_with("refused by policy: rule maintenance-needs-admin: anonymous may not open"),
        "{message}"
    );

    // An administrator and a store server.
    let admin = f.serve(Identity::Admin("alice".into()), AnonymousGrant::None);
    f.connect(&admin, "target/b").unwrap();
    let server = f.serve(Identity::Server("pvs2".into()), AnonymousGrant::None);
    f.connect(&server, "vdisk/win").unwrap();
    let (_, message) = refused(f.connect(&server, "target/a"));
    assert!(
        message.starts_with(
            "refused by policy: rule server-reads-vdisks: server:pvs2 may open only vdisk/NAME[@V]"
        ),
        "{message}"
    );
    assert_eq!(f.refusals().len(), 4);
}
