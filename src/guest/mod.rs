//! Guest-specific work the daemon does inside a VM from outside it: the Windows SAC static-IP
//! pass over the VM's serial console. The provider core decides when; this room only talks.

pub mod dialer;
pub mod sac;
