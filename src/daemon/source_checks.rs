//! The host's side of the source rules (`provider::sources`): resolving an http(s) image URL's
//! host, on a worker thread, because a DNS lookup blocks and the event loop must not.
//!
//! cocoon resolves the name again when it fetches: an answer that changes in between (DNS
//! rebinding) is out of reach without pinning the address, which cocoon's CLI cannot take.

use std::net::{IpAddr, ToSocketAddrs};

use crate::provider::sources;
use crate::provider::{SourceCheck, SourceVerdict};

/// The verdict on one check (blocking: run it on a worker).
pub(super) fn run(check: &SourceCheck) -> SourceVerdict {
    match check {
        SourceCheck::ImageHost { url, host } => image_host(url, host),
    }
}

fn image_host(url: &str, host: &str) -> SourceVerdict {
    let addrs: Vec<IpAddr> = match (host, 0u16).to_socket_addrs() {
        Ok(addrs) => addrs.map(|a| a.ip()).collect(),
        Err(e) => {
            return SourceVerdict::Unavailable(format!("image URL {url:?}: resolve {host}: {e}"))
        }
    };
    match sources::check_resolved(url, host, &addrs) {
        Ok(()) => SourceVerdict::Allowed,
        Err(msg) if addrs.is_empty() => SourceVerdict::Unavailable(msg),
        Err(msg) => SourceVerdict::Refused(msg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_for_loopback_is_refused_after_resolution() {
        // `localhost` itself is refused by name in the core; a numeric name such as
        // `2130706433` only resolves (libc reads it as 127.0.0.1).
        let check = SourceCheck::ImageHost {
            url: "http://2130706433/img".into(),
            host: "2130706433".into(),
        };
        match run(&check) {
            SourceVerdict::Refused(m) => assert!(m.contains("a loopback address"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
