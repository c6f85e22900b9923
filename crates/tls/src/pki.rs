//! The small certificate authority behind `vdstream pki` (owner: the pki work).
