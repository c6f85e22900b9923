//! `--server URL`: a store command sent to a running server's API instead of the store.
//! The API answers the document the local command would print (both are built by
//! `vdstream_store::documents`), so the command prints it the same way.

use anyhow::Result;
use clap::Args;
use vdstream_agent::client::Client;

/// The `--server` option of the store commands the API serves.
#[derive(Debug, Clone, Args)]
pub struct ServerOpt {
    /// Send the command to a running `vdstream server --http` (http://HOST:PORT) instead of the store.
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,
}

impl ServerOpt {
    /// The API client, when `--server` is given.
    pub fn client(&self) -> Result<Option<Client>> {
        Ok(self.server.as_deref().map(Client::new).transpose()?)
    }
}

/// Percent-encodes one path segment (names are checked by the server, as by the store).
pub fn seg(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn segments_are_percent_encoded() {
        assert_eq!(super::seg("win11.a_b-c"), "win11.a_b-c");
        assert_eq!(super::seg("a/b c@é"), "a%2Fb%20c%40%C3%A9");
    }
}
