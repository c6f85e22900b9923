//! `--handshake-penalty N` and `--handshake-penalty-exempt LIST`: when an NBD server closes
//! at accept the connections of a client address that keeps failing handshakes
//! (`vdstream_nbd::penalty`), shared by `vdstream server` and `serve-image`.

use anyhow::{anyhow, Result};
use clap::Args;
use vdstream_nbd::penalty::{parse_exempt, PenaltyConfig};

/// The NBD server's handshake-penalty flags.
#[derive(Debug, Clone, Default, Args)]
pub struct PenaltyFlags {
    /// Failed NBD handshakes (a certificate the server refuses, a stall past
    /// --handshake-timeout, bytes that are not NBD) one client address may make within a
    /// minute; then its new TCP connections are closed at accept, with no TLS work done for
    /// them, for 30 s, doubling each time it happens again, up to 10 minutes (as OpenSSH's
    /// PerSourcePenalties). An IPv6 client counts by its /64; a client that merely closes
    /// early (a health check) is not counted; connections already open are not touched.
    /// `vdstream server`'s HTTP API counts failed authentications (wrong or revoked
    /// tokens) by the same rules, and answers a penalized address 429.
    /// 0 turns penalties off. Default: 10.
    #[arg(long, value_name = "N")]
    pub handshake_penalty: Option<u32>,

    /// Client addresses or networks never penalized, comma-separated
    /// (example: 10.20.0.0/16,192.168.1.7,::1), or `none`. Unix-socket clients never are.
    /// Default: 127.0.0.1,::1 (this host itself).
    #[arg(long, value_name = "LIST")]
    pub handshake_penalty_exempt: Option<String>,
}

impl PenaltyFlags {
    /// The penalty settings: a flag wins over the config file's key (`file_n`,
    /// `file_exempt`), which wins over the default.
    pub fn config(&self, file_n: Option<u32>, file_exempt: Option<&str>) -> Result<PenaltyConfig> {
        let mut config = PenaltyConfig::default();
        if let Some(n) = self.handshake_penalty.or(file_n) {
            config.max_failures = n;
        }
        if let Some(list) = self.handshake_penalty_exempt.as_deref().or(file_exempt) {
            config.exempt =
                parse_exempt(list).map_err(|e| anyhow!("--handshake-penalty-exempt: {e}"))?;
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_file_and_bad_lists_are_named() {
        let none = PenaltyFlags::default();
        assert_eq!(none.config(None, None).unwrap(), PenaltyConfig::default());
        assert_eq!(none.config(Some(3), Some("none")).unwrap().max_failures, 3);
        assert!(none
            .config(Some(3), Some("none"))
            .unwrap()
            .exempt
            .is_empty());
        let flags = PenaltyFlags {
            handshake_penalty: Some(0),
            handshake_penalty_exempt: Some("10.0.0.0/8".into()),
        };
        let c = flags.config(Some(3), Some("none")).unwrap();
        assert_eq!((c.max_failures, c.exempt.len()), (0, 1));
        let bad = PenaltyFlags {
            handshake_penalty: None,
            handshake_penalty_exempt: Some("lab-net".into()),
        };
        let e = bad.config(None, None).unwrap_err().to_string();
        assert!(
            e.contains("--handshake-penalty-exempt") && e.contains("lab-net"),
            "{e}"
        );
    }
}
