//! The identity a verified peer certificate names (owner: the pki work).
