//! `NBD_OPT_INFO` on a server-type target's attach (`target/ID@ATTACH`) gets what
//! `NBD_OPT_GO` gets: without the attach's secret, or with a wrong one, the same fenced
//! refusal (`NBD_REP_ERR_POLICY`), so the published name tells nobody its size or flags;
//! with the secret, its size. Checked on both cache types, while the attach is held.

use std::sync::Arc;

use vdstream_blockdev::BlockDev;
use vdstream_contract::{ExportDescription, Identity};
use vdstream_nbd::server::{Exports, OpenError, OpenPurpose, OpenRequest};
use vdstream_server::exports::StoreExports;
use vdstream_server::{ServerOptions, ServerState};
use vdstream_store::vdisk::NewVdisk;
use vdstream_store::{NewTarget, Store};

fn open(
    exports: &StoreExports,
    name: &str,
    purpose: OpenPurpose,
) -> Result<vdstream_nbd::server::OpenedExport, OpenError> {
    exports.open_export(&OpenRequest {
        name,
        peer: "127.0.0.1:40000",
        client: &Identity::Local,
        purpose,
    })
}

#[test]
fn info_on_a_fenced_attach_is_refused_as_go_is() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open_or_create(dir.path().join("store")).unwrap();
    store
        .create_vdisk("win", 8 << 20, NewVdisk::default())
        .unwrap();
    for (id, cache) in [("s", "server"), ("p", "server-persistent")] {
        let t = NewTarget {
            id: id.into(),
            vdisk: "win".into(),
            cache: cache.into(),
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
    let state = ServerState::new(&ServerOptions {
        name: Some("pvs1".into()),
        ..ServerOptions::new(store.root())
    });
    let exports = Arc::new(StoreExports::new(state).unwrap());
    for id in ["s", "p"] {
        // The agent's attach: it is handed the secret, and holds the attach.
        let held = open(&exports, &format!("target/{id}"), OpenPurpose::Session).unwrap();
        let mut d: ExportDescription = held.description.clone().unwrap().parse().unwrap();
        let secret = d.take_secret().expect("a new attach is handed its secret");
        let pin = d
            .pin()
            .expect("the description names the attach")
            .to_string();
        for name in [
            pin.clone(),
            format!("{pin}#0123456789abcdef0123456789abcdef"),
        ] {
            let go = open(&exports, &name, OpenPurpose::Session)
                .map(|_| ())
                .unwrap_err();
            assert!(matches!(go, OpenError::Policy(_)), "GO {name}: {go}");
            let info = match open(&exports, &name, OpenPurpose::Info) {
                Ok(o) => panic!(
                    "INFO {name} answered (size {}) where GO is refused ({go})",
                    o.device.size()
                ),
                Err(e) => e,
            };
            assert!(
                matches!(info, OpenError::Policy(_)),
                "INFO {name} must be refused as GO is, got: {info}"
            );
            assert!(info.to_string().contains("is fenced"), "{info}");
        }
        // With the secret, INFO tells the size, and hands out no secret.
        let info = open(&exports, &format!("{pin}#{secret}"), OpenPurpose::Info).unwrap();
        assert_eq!(info.device.size(), 8 << 20);
        assert!(
            !info
                .description
                .clone()
                .unwrap_or_default()
                .contains(&secret),
            "INFO must not hand out the secret"
        );
        drop(info);
        // The attach still works for its agent after an INFO came and went.
        let again = open(&exports, &format!("{pin}#{secret}"), OpenPurpose::Session).unwrap();
        drop(again);
        drop(held);
    }
}
