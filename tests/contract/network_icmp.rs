//! The pinger and TCP probes on real sockets: loopback in the test's own namespace, and
//! namespaces the test creates for the unprivileged datagram socket and the fallback.

use crate::probes_support;

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use probes_support::{is_child, Netns};
use vk_cocoon::network::icmp::{PingError, PingStart, Pinger, PingerMode};
use vk_cocoon::network::tcp::TcpProbes;

/// Poll `pinger` until `want` replies arrived or `deadline` passed; returns the replies' ids.
fn collect(
    pinger: &mut Pinger,
    want: usize,
    deadline: Duration,
) -> Vec<vk_cocoon::network::icmp::PingId> {
    let mut poll = mio::Poll::new().unwrap();
    pinger.register(poll.registry(), mio::Token(1)).unwrap();
    let mut events = mio::Events::with_capacity(64);
    let end = Instant::now() + deadline;
    let mut got = Vec::new();
    while got.len() < want {
        let now = Instant::now();
        if now >= end {
            break;
        }
        poll.poll(&mut events, Some(end - now)).unwrap();
        if !events.is_empty() {
            got.extend(
                pinger
                    .on_readable(Instant::now())
                    .into_iter()
                    .map(|(id, r)| {
                        assert!(r.from.is_loopback(), "reply from {}", r.from);
                        assert!(r.rtt < Duration::from_secs(1));
                        id
                    }),
            );
        }
    }
    pinger.deregister(poll.registry()).unwrap();
    got
}

fn pending(start: Result<PingStart, PingError>) -> vk_cocoon::network::icmp::PingId {
    match start {
        Ok(PingStart::Pending(id)) => id,
        other => panic!("expected a pending echo, got {other:?}"),
    }
}

/// Thousands in flight on one socket, each matched to its own echo; expired ones ignored.
fn many_in_flight(mode: PingerMode) {
    let mut pinger = Pinger::with_mode(mode).expect("open pinger");
    let now = Instant::now();
    let mut sent = HashSet::new();
    let mut expired = HashSet::new();
    for i in 0..2000u32 {
        let ip = Ipv4Addr::new(127, 0, (i / 250) as u8, (i % 250 + 1) as u8);
        let id = pending(pinger.send(ip, now));
        if i % 10 == 0 {
            assert!(pinger.expire(id));
            expired.insert(id);
        } else {
            sent.insert(id);
        }
        // Drain as we go so that the socket's receive buffer never overflows.
        if i % 200 == 199 {
            for (id, _) in pinger.on_readable(Instant::now()) {
                assert!(sent.remove(&id), "unexpected or duplicate reply {id:?}");
            }
        }
    }
    let rest = sent.len();
    for id in collect(&mut pinger, rest, Duration::from_secs(5)) {
        assert!(sent.remove(&id), "unexpected or duplicate reply {id:?}");
    }
    assert!(sent.is_empty(), "{} echoes unanswered", sent.len());
    assert_eq!(pinger.in_flight(), 0);
    // Replies to expired echoes are read and dropped, never reported.
    assert!(collect(&mut pinger, 1, Duration::from_millis(100)).is_empty());
}

#[test]
fn raw_socket_matches_thousands_of_echoes_on_loopback() {
    match Pinger::with_mode(PingerMode::Raw) {
        Ok(_) => many_in_flight(PingerMode::Raw),
        Err(e) => println!("SKIP: no raw ICMP socket (needs CAP_NET_RAW): {e}"),
    }
}

#[test]
fn open_prefers_the_raw_socket_when_privileged() {
    if Pinger::with_mode(PingerMode::Raw).is_err() {
        println!("SKIP: no CAP_NET_RAW");
        return;
    }
    assert_eq!(Pinger::open().mode(), PingerMode::Raw);
}

#[test]
fn two_pingers_do_not_take_each_others_replies() {
    let (Ok(mut a), Ok(mut b)) = (
        Pinger::with_mode(PingerMode::Raw),
        Pinger::with_mode(PingerMode::Raw),
    ) else {
        println!("SKIP: no CAP_NET_RAW");
        return;
    };
    let now = Instant::now();
    let ia = pending(a.send(Ipv4Addr::new(127, 0, 0, 1), now));
    let ib = pending(b.send(Ipv4Addr::new(127, 0, 0, 1), now));
    assert_eq!(collect(&mut a, 1, Duration::from_secs(2)), vec![ia]);
    assert_eq!(collect(&mut b, 1, Duration::from_secs(2)), vec![ib]);
}

#[test]
fn unroutable_send_fails_at_once() {
    let Some(ns) = Netns::create("u") else { return };
    let out = ns.run_child("network_icmp::child_unroutable_send", false, &[]);
    assert!(out.status.success(), "child failed");
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
}

#[test]
#[ignore = "helper: run by unroutable_send_fails_at_once inside a namespace"]
fn child_unroutable_send() {
    if !is_child("child_unroutable_send") {
        return;
    }
    // A fresh namespace has only loopback: 10.99.0.1 has no route.
    let mut p = Pinger::open();
    assert_ne!(p.mode(), PingerMode::AssumeReachable);
    let err = p
        .send(Ipv4Addr::new(10, 99, 0, 1), Instant::now())
        .unwrap_err();
    assert!(matches!(err, PingError::Send(_)), "{err}");
    assert_eq!(p.in_flight(), 0);
}

#[test]
fn datagram_socket_works_without_cap_net_raw() {
    let Some(ns) = Netns::create("d") else { return };
    let out = ns.run_child(
        "network_icmp::child_datagram_pinger",
        true,
        &[("VK_PROBES_PING_GROUPS", "0 0")],
    );
    assert!(out.status.success(), "child failed");
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
}

#[test]
#[ignore = "helper: run by datagram_socket_works_without_cap_net_raw inside a namespace"]
fn child_datagram_pinger() {
    if !is_child("child_datagram_pinger") {
        return;
    }
    // ping_group_range is per namespace: this changes only the test's own namespace.
    let groups = std::env::var("VK_PROBES_PING_GROUPS").unwrap();
    std::fs::write("/proc/sys/net/ipv4/ping_group_range", groups).unwrap();
    let raw = Pinger::with_mode(PingerMode::Raw);
    assert!(raw.is_err(), "CAP_NET_RAW should be gone");
    let pinger = Pinger::open();
    assert_eq!(pinger.mode(), PingerMode::Datagram);
    drop(pinger);
    many_in_flight(PingerMode::Datagram);
}

#[test]
fn falls_back_when_neither_socket_is_allowed() {
    let Some(ns) = Netns::create("f") else { return };
    let out = ns.run_child("network_icmp::child_fallback_pinger", true, &[]);
    assert!(out.status.success(), "child failed");
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
}

#[test]
#[ignore = "helper: run by falls_back_when_neither_socket_is_allowed inside a namespace"]
fn child_fallback_pinger() {
    if !is_child("child_fallback_pinger") {
        return;
    }
    // The kernel default "1 0" allows no group to open ping sockets.
    std::fs::write("/proc/sys/net/ipv4/ping_group_range", "1 0").unwrap();
    assert!(Pinger::with_mode(PingerMode::Raw).is_err());
    assert!(Pinger::with_mode(PingerMode::Datagram).is_err());
    let mut p = Pinger::open();
    assert_eq!(p.mode(), PingerMode::AssumeReachable);
    // Registering and reading are harmless no-ops; a resolved IP counts as reachable.
    let poll = mio::Poll::new().unwrap();
    p.register(poll.registry(), mio::Token(1)).unwrap();
    assert_eq!(
        p.send(Ipv4Addr::new(10, 99, 0, 1), Instant::now()).unwrap(),
        PingStart::AssumedReachable
    );
    assert!(p.on_readable(Instant::now()).is_empty());
}

fn run_tcp(addr: SocketAddr) -> std::io::Result<()> {
    let mut poll = mio::Poll::new().unwrap();
    let mut probes = TcpProbes::new();
    probes.start(mio::Token(7), addr, poll.registry())?;
    let mut events = mio::Events::with_capacity(8);
    let end = Instant::now() + Duration::from_secs(3);
    loop {
        let now = Instant::now();
        assert!(now < end, "connect did not finish");
        poll.poll(&mut events, Some(end - now)).unwrap();
        for ev in events.iter() {
            if let Some(r) = probes.on_event(ev.token(), poll.registry()) {
                assert_eq!(probes.in_flight(), 0);
                return r;
            }
        }
    }
}

#[test]
fn tcp_connect_succeeds_on_a_listener_and_fails_on_a_closed_port() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    run_tcp(addr).expect("connect to a listening port");
    drop(listener);
    let err = run_tcp(addr).expect_err("nothing listens any more");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
}

#[test]
fn tcp_cancel_drops_the_connect() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let poll = mio::Poll::new().unwrap();
    let mut probes = TcpProbes::new();
    probes
        .start(
            mio::Token(3),
            listener.local_addr().unwrap(),
            poll.registry(),
        )
        .unwrap();
    assert!(probes.cancel(mio::Token(3), poll.registry()));
    assert!(!probes.cancel(mio::Token(3), poll.registry()));
    assert_eq!(probes.in_flight(), 0);
    assert!(probes.on_event(mio::Token(3), poll.registry()).is_none());
}
