//! PLACEHOLDER: the conformance suite is being written.
