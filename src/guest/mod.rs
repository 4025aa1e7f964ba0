//! Guest-specific work the daemon does inside a VM from outside it: the Windows SAC static-IP
//! pass over the VM's serial console, and the `cocoon-macos` CLI of macOS guests. The provider
//! core decides when; this room only talks.

pub mod dialer;
pub mod macos;
pub mod sac;
