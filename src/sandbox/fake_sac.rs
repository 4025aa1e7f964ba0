//! A fake Windows SAC console on a Unix socket, answering like the real one: boot noise and
//! garbage, a `SAC>` prompt only after CR LF, `i` listings of `Net: <n>, Ip=<addr>` lines
//! written in pieces, and `i <n> <ip> <mask> <gw>` changing an interface. Test tooling only.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How the fake console behaves.
#[derive(Debug, Clone)]
pub struct SacBehaviour {
    /// Interfaces as (n, ip), in listing order.
    pub nets: Vec<(u32, String)>,
    /// The first this-many `i` listings show only the first interface (NICs still arriving).
    pub partial_listings: u32,
    /// Delay before each prompt and between the pieces of a listing.
    pub delay: Duration,
    /// `i <n> ...` is acknowledged but changes nothing (an address that never takes).
    pub ignore_sets: bool,
}

impl Default for SacBehaviour {
    fn default() -> Self {
        SacBehaviour {
            nets: vec![(10, "169.254.10.1".into())],
            partial_listings: 0,
            delay: Duration::from_millis(20),
            ignore_sets: false,
        }
    }
}

/// What a fake console saw and holds: the command lines received and the interfaces now.
#[derive(Debug, Default)]
pub struct SacRecord {
    pub commands: Vec<String>,
    pub nets: Vec<(u32, String)>,
}

/// Serves every connection to `listener` on a thread of its own (one at a time, as a serial
/// console does); returns the shared record.
pub fn serve(listener: UnixListener, behaviour: SacBehaviour) -> Arc<Mutex<SacRecord>> {
    let record = Arc::new(Mutex::new(SacRecord {
        commands: Vec::new(),
        nets: behaviour.nets.clone(),
    }));
    let shared = record.clone();
    std::thread::spawn(move || {
        let mut listings = 0;
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            session(conn, &behaviour, &shared, &mut listings);
        }
    });
    record
}

fn session(mut conn: UnixStream, b: &SacBehaviour, record: &Mutex<SacRecord>, listings: &mut u32) {
    // What a console shows before anyone pressed a key: noise, no prompt.
    let _ =
        conn.write_all(b"\x1b[2J\xff\xfe boot: EMS enabled\r\nComputer is booting, SAC started");
    let mut line = Vec::new();
    let mut chunk = [0u8; 512];
    loop {
        let n = match conn.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        for &c in &chunk[..n] {
            if c != b'\r' && c != b'\n' {
                line.push(c);
                continue;
            }
            if c == b'\n' && line.is_empty() {
                continue;
            }
            let cmd = String::from_utf8_lossy(&line).trim().to_string();
            line.clear();
            std::thread::sleep(b.delay);
            let reply = answer(&cmd, b, record, listings);
            for piece in reply.chunks(reply.len().div_ceil(3).max(1)) {
                if conn.write_all(piece).is_err() {
                    return;
                }
                std::thread::sleep(b.delay);
            }
        }
    }
}

fn answer(cmd: &str, b: &SacBehaviour, record: &Mutex<SacRecord>, listings: &mut u32) -> Vec<u8> {
    let mut rec = match record.lock() {
        Ok(r) => r,
        Err(p) => p.into_inner(),
    };
    if !cmd.is_empty() {
        rec.commands.push(cmd.to_string());
    }
    let words: Vec<&str> = cmd.split_whitespace().collect();
    let body = match words.as_slice() {
        [] => String::new(),
        ["i"] => {
            *listings += 1;
            let shown = if *listings <= b.partial_listings {
                1
            } else {
                rec.nets.len()
            };
            rec.nets
                .iter()
                .take(shown)
                .map(|(n, ip)| {
                    format!("Net: {n}, Ip={ip}  Subnet=255.255.0.0  Gateway=0.0.0.0\r\n")
                })
                .collect()
        }
        ["i", n, ip, _mask, ..] => match n.parse::<u32>() {
            Ok(n) if rec.nets.iter().any(|(m, _)| *m == n) => {
                if !b.ignore_sets {
                    for net in rec.nets.iter_mut().filter(|(m, _)| *m == n) {
                        net.1 = ip.to_string();
                    }
                }
                "The IP address was set.\r\n".into()
            }
            _ => "Error: the specified network interface was not found.\r\n".into(),
        },
        _ => "Unrecognized command.  Type ? for help.\r\n".into(),
    };
    format!("\r\n{body}\r\nSAC>").into_bytes()
}
