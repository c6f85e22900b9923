//! A certificate directory turned into rustls configurations (owner: the NBD TLS work).
//! See the crate docs for the layout.
