//! Guest networking: the cocoon-net lease file, lease release, and the ICMPv4 pinger.
//! Parsers and sockets only; probe scheduling lives in probes.

pub mod icmp;
pub mod leases;
pub mod release;
pub mod tcp;
