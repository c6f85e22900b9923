//! The NBD protocol for vdstream: constants, wire codec, the server session and an async
//! client. This crate knows the [`vdstream_blockdev::BlockDev`] trait and nothing of how any
//! device stores bytes.

pub mod proto;
