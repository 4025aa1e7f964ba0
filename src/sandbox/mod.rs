//! The embedded sandbox: a fake Kubernetes API server and a fake cocoon for tests and demos.
//! Test infrastructure that follows the specs; the daemon itself never depends on it.

pub mod apiserver;
pub mod fake_cocoon;
