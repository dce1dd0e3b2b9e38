//! The stateright model (placeholder filled in below).
