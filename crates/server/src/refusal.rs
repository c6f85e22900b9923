//! The audit trail of refused opens: every open the authorization policy refuses
//! ([`crate::policy`]) becomes a line `nbd.open.refused` in the store's `audit.log`, naming
//! the client's identity, its peer address (`unix` or `IP:PORT`), the export (never its attach secret), the NBD
//! option and the rule.
//!
//! ```json
//! {"time":"…","user":"vdstream","host":"pvs1","pid":42,"action":"nbd.open.refused","vdisk":"win11",
//!  "details":{"identity":"target:pc-07","peer":"10.0.0.7:51234","export":"target/pc-08","option":"go","rule":"target-own-exports"}}
//! ```
//!
//! Bounded: a hostile client can provoke refusals at will, so lines pass a token bucket
//! ([`AUDIT_BURST`] at once, then [`AUDIT_PER_SECOND`] a second); refusals held back are
//! counted, and the next line written carries `"suppressed": N`, so the trail says how many
//! there were without growing faster than the bucket allows (one line of about 300 bytes a
//! second: at most ~26 MB a day under a constant flood). A failure to write the trail is
//! logged (rate-limited) and does not change the answer, which is a refusal anyway.

use std::time::Instant;

use serde_json::json;
use vdstream_contract::{ExportName, Identity};
use vdstream_nbd::lograte::{LogLimiter, Verdict};
use vdstream_nbd::server::OpenPurpose;
use vdstream_store::Store;

use crate::policy::Refusal;

/// The audit action of a refused open.
pub const REFUSED_ACTION: &str = "nbd.open.refused";

/// Refusals recorded at once before the rate applies.
pub const AUDIT_BURST: u32 = 30;

/// Refusals recorded a second, on average, once the burst is spent.
pub const AUDIT_PER_SECOND: u32 = 1;

/// One refused open, as the audit line shows it.
#[derive(Debug, Clone, Copy)]
pub struct RefusedOpen<'a> {
    pub client: &'a Identity,
    /// `unix` or the peer's `IP:PORT`.
    pub peer: &'a str,
    pub export: &'a ExportName,
    pub purpose: OpenPurpose,
    pub refusal: &'a Refusal,
}

/// Writes refusals to the audit trail, bounded (see the module docs).
#[derive(Debug)]
pub struct RefusalAudit {
    bucket: LogLimiter,
    /// Failures to write the trail reach the server log through this.
    log: LogLimiter,
}

impl Default for RefusalAudit {
    fn default() -> Self {
        RefusalAudit {
            bucket: LogLimiter::new(AUDIT_PER_SECOND, AUDIT_BURST),
            log: LogLimiter::default(),
        }
    }
}

impl RefusalAudit {
    /// Records `r` in `store`'s audit trail unless the bucket is empty (then it is counted).
    /// `vdisk()` names the vDisk the export reaches (`""` when unknown), so that `vdstream
    /// audit NAME` shows the line; it is called only for a line that is written. Returns
    /// whether a line was written.
    pub fn record(
        &self,
        store: &Store,
        r: &RefusedOpen<'_>,
        vdisk: impl FnOnce() -> String,
    ) -> bool {
        let suppressed = match self.bucket.check_at(REFUSED_ACTION, Instant::now()) {
            Verdict::Suppress => return false,
            Verdict::Log { suppressed } => suppressed,
        };
        let mut details = json!({
            "identity": r.client.to_string(),
            "peer": r.peer,
            "export": r.export.shown(),
            "option": match r.purpose { OpenPurpose::Info => "info", OpenPurpose::Session => "go" },
            "rule": r.refusal.rule,
        });
        if suppressed > 0 {
            details["suppressed"] = json!(suppressed);
        }
        match store.audit_event(REFUSED_ACTION, &vdisk(), details) {
            Ok(()) => true,
            Err(e) => {
                self.log.log(
                    log::Level::Warn,
                    module_path!(),
                    "audit write failed",
                    format_args!(
                        "cannot record a refused open in the audit trail ({} from {}, {}): {e}",
                        r.client,
                        r.peer,
                        r.export.shown()
                    ),
                );
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vdstream_store::audit;

    #[test]
    fn a_flood_of_refusals_is_bounded_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = Store::open_or_create(dir.path().join("s")).unwrap();
        let audit_log = RefusalAudit::default();
        let client = Identity::Target("a".into());
        let export: ExportName = "target/b@k1#00ff".parse().unwrap();
        let refusal = Refusal {
            rule: crate::policy::TARGET_OWN_EXPORTS,
            message: "no".into(),
        };
        let r = RefusedOpen {
            client: &client,
            peer: "10.0.0.7:5000",
            export: &export,
            purpose: OpenPurpose::Session,
            refusal: &refusal,
        };
        let written = (0..500)
            .filter(|_| audit_log.record(&store, &r, String::new))
            .count();
        // The burst, and perhaps a refill or two if the machine is slow.
        assert!(
            (AUDIT_BURST as usize..AUDIT_BURST as usize + 5).contains(&written),
            "{written} lines for 500 refusals"
        );
        let lines = audit::read(&store.audit_path(), None, None).unwrap();
        assert_eq!(lines.len(), written);
        let e = &lines[0];
        assert_eq!(
            (e.action.as_str(), e.client.as_deref()),
            (REFUSED_ACTION, None),
            "client: an API client only"
        );
        assert_eq!(
            e.details,
            json!({"identity": "target:a", "peer": "10.0.0.7:5000", "export": "target/b@k1", "option": "go", "rule": "target-own-exports"})
        );
        // Once the bucket refills, the next line says how many were held back.
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert!(audit_log.record(&store, &r, String::new));
        let last = audit::read(&store.audit_path(), None, Some(1))
            .unwrap()
            .pop()
            .unwrap();
        assert_eq!(last.details["suppressed"], json!(500 - written as u64));
    }
}
