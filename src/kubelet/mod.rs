//! The kubelet HTTPS API on 10250: authentication, logs, exec and attach, stats.
//! Serves from the event loop; the VM facts it needs come from the daemon.

pub mod stats;
