//! The Windows SAC static-IP pass as a protocol state machine: events in (connected, bytes
//! read, read deadline passed, ...), one I/O request out at a time. No socket, no clock here.
//!
//! SAC (the Special Administration Console of Windows' Emergency Management Services) talks on
//! the VM's serial console: a text protocol whose prompt is `SAC>`. The pass dials the console,
//! wakes the prompt, enumerates the network interfaces with `i` until every NIC is listed
//! (`Net: <n>, Ip=<addr>` lines), then for each static NIC sends
//! `i <n> <ip> <mask> <gateway>` and checks with `i` that the address took.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

/// How long the console may take to accept a connection, and how often it is dialled again.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
const DIAL_RETRY: Duration = Duration::from_secs(2);
const DIAL_BUDGET: Duration = Duration::from_secs(60);
/// Each read waits at most this long; the prompt must show within `PROMPT_BUDGET`.
const READ_DEADLINE: Duration = Duration::from_secs(5);
const PROMPT_BUDGET: Duration = Duration::from_secs(60);
/// Input pending before a command is read for this long and dropped.
const DISCARD_WINDOW: Duration = Duration::from_millis(200);
/// A command's output must end with the prompt within this long.
const COMMAND_BUDGET: Duration = Duration::from_secs(5);
const ENUM_ATTEMPTS: u32 = 60;
const SET_TRIES: u32 = 10;
const RETRY_PAUSE: Duration = Duration::from_secs(2);
/// The console output kept while waiting for a prompt (a chatty console cannot grow it).
const BUFFER_MAX: usize = 64 * 1024;

const PROMPT: &str = "SAC>";

/// One static NIC to set: its position among the VM's NICs and its address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticNic {
    pub index: usize,
    pub ip: Ipv4Addr,
    pub mask: Ipv4Addr,
    pub gateway: Option<Ipv4Addr>,
}

/// What the pass must do: how many NICs the guest has and which of them are static.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SacPlan {
    pub nic_count: usize,
    pub statics: Vec<StaticNic>,
}

impl SacPlan {
    /// A plan from the VM's NICs as (static IP, prefix, gateway); empty IP = DHCP. Every value
    /// must parse as IPv4 (SAC sets nothing else); a prefix outside 1..=32 means /24.
    pub fn from_nics(nics: &[(String, u64, String)]) -> Result<SacPlan, String> {
        let mut statics = Vec::new();
        for (index, (ip, prefix, gw)) in nics.iter().enumerate() {
            if ip.is_empty() {
                continue;
            }
            let ip: Ipv4Addr = ip
                .trim()
                .parse()
                .map_err(|_| format!("nic {index}: static IP {ip:?} is not an IPv4 address"))?;
            let gateway =
                if gw.trim().is_empty() {
                    None
                } else {
                    Some(gw.trim().parse().map_err(|_| {
                        format!("nic {index}: gateway {gw:?} is not an IPv4 address")
                    })?)
                };
            statics.push(StaticNic {
                index,
                ip,
                mask: mask_of(*prefix),
                gateway,
            });
        }
        Ok(SacPlan {
            nic_count: nics.len(),
            statics,
        })
    }
}

/// The dotted mask of a prefix; outside 1..=32 it is 255.255.255.0.
pub fn mask_of(prefix: u64) -> Ipv4Addr {
    if !(1..=32).contains(&prefix) {
        return Ipv4Addr::new(255, 255, 255, 0);
    }
    Ipv4Addr::from(u32::MAX << (32 - prefix))
}

/// Why the pass failed: the Warning reason and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SacError {
    pub reason: &'static str,
    pub message: String,
}

pub const DIAL_FAILED: &str = "PostCloneSACDialFailed";
pub const ENUM_FAILED: &str = "PostCloneSACEnumFailed";
pub const SET_FAILED: &str = "PostCloneSACSetFailed";
pub const VERIFY_FAILED: &str = "PostCloneSACVerifyFailed";

fn fail(reason: &'static str, message: impl Into<String>) -> Io {
    Io::Finished(Err(SacError {
        reason,
        message: message.into(),
    }))
}

/// The one I/O the driver performs next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Io {
    /// Connect to the console socket (within [`DIAL_TIMEOUT`]).
    Connect,
    /// Write these bytes.
    Write(Vec<u8>),
    /// Read what arrives until this instant (report [`Event::ReadTimeout`] when none did).
    Read { until: Instant },
    /// Do nothing until this instant, then report [`Event::Slept`].
    Sleep { until: Instant },
    /// The pass is over.
    Finished(Result<(), SacError>),
}

/// What happened to the last I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Connected,
    ConnectFailed(String),
    Written,
    WriteFailed(String),
    Read(Vec<u8>),
    ReadTimeout,
    /// End of stream or a read error.
    Closed(String),
    Slept,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    Enumerate { attempt: u32 },
    Set { nic: usize, attempt: u32 },
    Verify { nic: usize, attempt: u32 },
}

impl Purpose {
    fn reason(self) -> &'static str {
        match self {
            Purpose::Enumerate { .. } => ENUM_FAILED,
            Purpose::Set { .. } => SET_FAILED,
            Purpose::Verify { .. } => VERIFY_FAILED,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Dialling {
        since: Instant,
    },
    DialPause {
        since: Instant,
    },
    /// CR LF written (or being written); reading until the prompt.
    Waking {
        until: Instant,
        writing: bool,
    },
    /// Dropping what the console printed before the command.
    Discarding {
        purpose: Purpose,
        until: Instant,
    },
    Sending {
        purpose: Purpose,
    },
    Reading {
        purpose: Purpose,
        until: Instant,
    },
    Pausing {
        next: Purpose,
    },
    Done,
}

/// The SAC pass. Start with [`SacPass::start`], then feed each I/O's [`Event`] to
/// [`SacPass::on`] until it returns [`Io::Finished`].
#[derive(Debug)]
pub struct SacPass {
    plan: SacPlan,
    state: State,
    buf: Vec<u8>,
    /// Interfaces SAC listed: (n, ip), first listing order, one per n.
    nets: Vec<(u32, String)>,
}

impl SacPass {
    pub fn start(plan: SacPlan, now: Instant) -> (SacPass, Io) {
        let pass = SacPass {
            plan,
            state: State::Dialling { since: now },
            buf: Vec::new(),
            nets: Vec::new(),
        };
        (pass, Io::Connect)
    }

    /// The interfaces the last enumeration listed.
    pub fn interfaces(&self) -> &[(u32, String)] {
        &self.nets
    }

    pub fn on(&mut self, ev: Event, now: Instant) -> Io {
        let io = self.step(ev, now);
        if matches!(io, Io::Finished(_)) {
            self.state = State::Done;
        }
        io
    }

    fn step(&mut self, ev: Event, now: Instant) -> Io {
        match (self.state.clone(), ev) {
            (State::Done, _) => fail(DIAL_FAILED, "the SAC pass is already over"),
            (State::Dialling { .. }, Event::Connected) => {
                self.buf.clear();
                self.state = State::Waking {
                    until: now + PROMPT_BUDGET,
                    writing: true,
                };
                Io::Write(b"\r\n".to_vec())
            }
            (State::Dialling { since }, Event::ConnectFailed(e)) => {
                if now + DIAL_RETRY > since + DIAL_BUDGET {
                    return fail(
                        DIAL_FAILED,
                        format!("dial SAC console: {e} (retried for 60s)"),
                    );
                }
                self.state = State::DialPause { since };
                Io::Sleep {
                    until: now + DIAL_RETRY,
                }
            }
            (State::DialPause { since }, Event::Slept) => {
                self.state = State::Dialling { since };
                Io::Connect
            }
            (State::Waking { until, .. }, Event::Written) => {
                self.state = State::Waking {
                    until,
                    writing: false,
                };
                Io::Read {
                    until: (now + READ_DEADLINE).min(until),
                }
            }
            (State::Waking { until, .. }, Event::Read(b)) => {
                self.take(&b);
                if self.has_prompt() {
                    return self.command(Purpose::Enumerate { attempt: 1 }, now);
                }
                Io::Read {
                    until: (now + READ_DEADLINE).min(until),
                }
            }
            (State::Waking { until, .. }, Event::ReadTimeout) => {
                if now >= until {
                    return fail(DIAL_FAILED, "no SAC> prompt on the console within 60s");
                }
                // Nudge the console again: a prompt may have been printed before we listened.
                self.state = State::Waking {
                    until,
                    writing: true,
                };
                Io::Write(b"\r\n".to_vec())
            }
            (State::Waking { .. }, Event::WriteFailed(e) | Event::Closed(e)) => {
                fail(DIAL_FAILED, format!("SAC console: {e}"))
            }
            (State::Discarding { until, .. }, Event::Read(_)) => Io::Read { until },
            (State::Discarding { purpose, .. }, Event::ReadTimeout) => {
                self.buf.clear();
                self.state = State::Sending { purpose };
                Io::Write(format!("{}\r\n", self.text_of(purpose)).into_bytes())
            }
            (State::Sending { purpose }, Event::Written) => {
                self.state = State::Reading {
                    purpose,
                    until: now + COMMAND_BUDGET,
                };
                Io::Read {
                    until: now + COMMAND_BUDGET,
                }
            }
            (State::Reading { purpose, until }, Event::Read(b)) => {
                self.take(&b);
                if self.has_prompt() {
                    return self.answered(purpose, now);
                }
                Io::Read { until }
            }
            (State::Reading { purpose, .. }, Event::ReadTimeout) => self.unanswered(
                purpose,
                format!("no SAC> prompt within 5s after {:?}", self.text_of(purpose)),
                now,
            ),
            (
                State::Discarding { purpose, .. }
                | State::Sending { purpose }
                | State::Reading { purpose, .. },
                Event::WriteFailed(e) | Event::Closed(e),
            ) => fail(purpose.reason(), format!("SAC console: {e}")),
            (State::Pausing { next }, Event::Slept) => self.command(next, now),
            (state, ev) => fail(
                DIAL_FAILED,
                format!("SAC pass: unexpected {ev:?} in {state:?}"),
            ),
        }
    }

    /// Start a command: drop pending input first.
    fn command(&mut self, purpose: Purpose, now: Instant) -> Io {
        let until = now + DISCARD_WINDOW;
        self.state = State::Discarding { purpose, until };
        Io::Read { until }
    }

    fn text_of(&self, purpose: Purpose) -> String {
        match purpose {
            Purpose::Enumerate { .. } | Purpose::Verify { .. } => "i".into(),
            Purpose::Set { nic, .. } => {
                let s = &self.plan.statics[nic];
                let n = self.net_of(nic).map(|(n, _)| n).unwrap_or_default();
                match s.gateway {
                    Some(gw) => format!("i {n} {} {} {gw}", s.ip, s.mask),
                    None => format!("i {n} {} {}", s.ip, s.mask),
                }
            }
        }
    }

    /// The SAC interface of the plan's `nic`-th static NIC: the one listed at its index.
    fn net_of(&self, nic: usize) -> Option<(u32, String)> {
        let index = self.plan.statics.get(nic)?.index;
        self.nets.get(index).cloned()
    }

    /// A command's output ended with the prompt.
    fn answered(&mut self, purpose: Purpose, now: Instant) -> Io {
        let out = String::from_utf8_lossy(&self.buf).into_owned();
        match purpose {
            Purpose::Enumerate { attempt } => {
                for (n, ip) in parse_nets(&out) {
                    if !self.nets.iter().any(|(m, _)| *m == n) {
                        self.nets.push((n, ip));
                    }
                }
                if self.nets.len() >= self.plan.nic_count {
                    return self.next_nic(0, now);
                }
                self.enumerate_again(attempt, now)
            }
            Purpose::Set { nic, attempt } => self.command(Purpose::Verify { nic, attempt }, now),
            Purpose::Verify { nic, attempt } => {
                let want = self.plan.statics[nic].ip.to_string();
                let n = self.net_of(nic).map(|(n, _)| n);
                let took = parse_nets(&out)
                    .iter()
                    .any(|(m, ip)| Some(*m) == n && *ip == want);
                if took {
                    return self.next_nic(nic + 1, now);
                }
                if attempt >= SET_TRIES {
                    return fail(
                        VERIFY_FAILED,
                        format!(
                            "SAC interface {} never showed Ip={want} after {SET_TRIES} tries",
                            n.unwrap_or_default()
                        ),
                    );
                }
                self.state = State::Pausing {
                    next: Purpose::Set {
                        nic,
                        attempt: attempt + 1,
                    },
                };
                Io::Sleep {
                    until: now + RETRY_PAUSE,
                }
            }
        }
    }

    /// A command got no prompt back in time.
    fn unanswered(&mut self, purpose: Purpose, err: String, now: Instant) -> Io {
        match purpose {
            Purpose::Enumerate { attempt } => self.enumerate_again(attempt, now),
            Purpose::Set { .. } => fail(SET_FAILED, err),
            Purpose::Verify { nic, attempt } if attempt < SET_TRIES => {
                self.state = State::Pausing {
                    next: Purpose::Set {
                        nic,
                        attempt: attempt + 1,
                    },
                };
                Io::Sleep {
                    until: now + RETRY_PAUSE,
                }
            }
            Purpose::Verify { .. } => fail(VERIFY_FAILED, err),
        }
    }

    fn enumerate_again(&mut self, attempt: u32, now: Instant) -> Io {
        if attempt >= ENUM_ATTEMPTS {
            return fail(
                ENUM_FAILED,
                format!(
                    "SAC listed {} of {} interfaces after {ENUM_ATTEMPTS} tries",
                    self.nets.len(),
                    self.plan.nic_count
                ),
            );
        }
        self.state = State::Pausing {
            next: Purpose::Enumerate {
                attempt: attempt + 1,
            },
        };
        Io::Sleep {
            until: now + RETRY_PAUSE,
        }
    }

    fn next_nic(&mut self, nic: usize, now: Instant) -> Io {
        if nic >= self.plan.statics.len() {
            return Io::Finished(Ok(()));
        }
        self.command(Purpose::Set { nic, attempt: 1 }, now)
    }

    fn take(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
        if self.buf.len() > BUFFER_MAX {
            let cut = self.buf.len() - BUFFER_MAX;
            self.buf.drain(..cut);
        }
    }

    fn has_prompt(&self) -> bool {
        self.buf
            .windows(PROMPT.len())
            .any(|w| w == PROMPT.as_bytes())
    }
}

/// The `Net: <n>, Ip=<addr>` entries of SAC's `i` output, in order (other lines ignored).
pub fn parse_nets(out: &str) -> Vec<(u32, String)> {
    let mut v = Vec::new();
    for line in out.lines() {
        let Some(rest) = line.trim_start().strip_prefix("Net: ") else {
            continue;
        };
        let Some((n, rest)) = rest.split_once(',') else {
            continue;
        };
        let Ok(n) = n.trim().parse::<u32>() else {
            continue;
        };
        let Some(addr) = rest.trim_start().strip_prefix("Ip=") else {
            continue;
        };
        let addr: String = addr
            .chars()
            .take_while(|c| !c.is_whitespace() && *c != ',')
            .collect();
        v.push((n, addr));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> SacPlan {
        SacPlan::from_nics(&[
            ("".into(), 0, "".into()),
            ("10.1.0.5".into(), 24, "10.1.0.1".into()),
        ])
        .unwrap()
    }

    /// Drive to the first command's write; returns the pass and the written command.
    fn to_first_command(now: &mut Instant) -> (SacPass, Io) {
        let (mut p, io) = SacPass::start(plan(), *now);
        assert_eq!(io, Io::Connect);
        assert_eq!(p.on(Event::Connected, *now), Io::Write(b"\r\n".to_vec()));
        assert!(matches!(p.on(Event::Written, *now), Io::Read { .. }));
        // Garbage, then the prompt split over two reads.
        assert!(matches!(
            p.on(Event::Read(b"\x00\xffboot noise\r\nSA".to_vec()), *now),
            Io::Read { .. }
        ));
        let io = p.on(Event::Read(b"C>".to_vec()), *now);
        assert_eq!(
            io,
            Io::Read {
                until: *now + DISCARD_WINDOW
            }
        );
        *now += DISCARD_WINDOW;
        let io = p.on(Event::ReadTimeout, *now);
        (p, io)
    }

    #[test]
    fn masks_follow_prefixes_with_slash_24_for_nonsense() {
        assert_eq!(mask_of(24), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(mask_of(16), Ipv4Addr::new(255, 255, 0, 0));
        assert_eq!(mask_of(32), Ipv4Addr::new(255, 255, 255, 255));
        assert_eq!(mask_of(1), Ipv4Addr::new(128, 0, 0, 0));
        assert_eq!(mask_of(0), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(mask_of(33), Ipv4Addr::new(255, 255, 255, 0));
    }

    #[test]
    fn plans_refuse_values_that_are_not_ipv4() {
        for (ip, gw) in [("10.0.0.1 x", ""), ("fe80::1", ""), ("10.0.0.1", "gw")] {
            assert!(SacPlan::from_nics(&[(ip.into(), 24, gw.into())]).is_err());
        }
    }

    #[test]
    fn net_lines_parse_with_their_order_and_ignore_the_rest() {
        let out = "i\r\nNet: 10, Ip=169.254.1.2  Subnet=255.255.0.0  Gateway=0.0.0.0\r\n\
                   junk Net: 3\r\nNet: 11, Ip=10.1.0.5\r\nNet: x, Ip=1.2.3.4\r\nSAC>";
        assert_eq!(
            parse_nets(out),
            vec![(10, "169.254.1.2".into()), (11, "10.1.0.5".into())]
        );
    }

    #[test]
    fn a_full_pass_enumerates_sets_the_static_nic_and_verifies_it() {
        let mut now = Instant::now();
        let (mut p, io) = to_first_command(&mut now);
        assert_eq!(io, Io::Write(b"i\r\n".to_vec()));
        assert!(matches!(p.on(Event::Written, now), Io::Read { .. }));
        // Only one interface listed yet: enumerate again 2 s later.
        let io = p.on(
            Event::Read(b"Net: 10, Ip=169.254.1.2\r\nSAC>".to_vec()),
            now,
        );
        assert_eq!(
            io,
            Io::Sleep {
                until: now + RETRY_PAUSE
            }
        );
        now += RETRY_PAUSE;
        assert!(matches!(p.on(Event::Slept, now), Io::Read { .. }));
        now += DISCARD_WINDOW;
        assert_eq!(p.on(Event::ReadTimeout, now), Io::Write(b"i\r\n".to_vec()));
        p.on(Event::Written, now);
        let io = p.on(
            Event::Read(b"Net: 10, Ip=169.254.1.2\r\nNet: 11, Ip=169.254.9.9\r\nSAC>".to_vec()),
            now,
        );
        assert!(matches!(io, Io::Read { .. }), "discard before the set");
        assert_eq!(p.interfaces().len(), 2);
        now += DISCARD_WINDOW;
        // The static NIC is the second: SAC's interface 11.
        assert_eq!(
            p.on(Event::ReadTimeout, now),
            Io::Write(b"i 11 10.1.0.5 255.255.255.0 10.1.0.1\r\n".to_vec())
        );
        p.on(Event::Written, now);
        assert!(matches!(
            p.on(Event::Read(b"SAC>".to_vec()), now),
            Io::Read { .. }
        ));
        now += DISCARD_WINDOW;
        assert_eq!(p.on(Event::ReadTimeout, now), Io::Write(b"i\r\n".to_vec()));
        p.on(Event::Written, now);
        let io = p.on(
            Event::Read(b"Net: 10, Ip=169.254.1.2\r\nNet: 11, Ip=10.1.0.5\r\nSAC>".to_vec()),
            now,
        );
        assert_eq!(io, Io::Finished(Ok(())));
    }

    #[test]
    fn dialling_retries_every_two_seconds_for_a_minute() {
        let mut now = Instant::now();
        let (mut p, _) = SacPass::start(plan(), now);
        let mut dials = 1;
        let err = loop {
            match p.on(Event::ConnectFailed("refused".into()), now) {
                Io::Sleep { until } => {
                    assert_eq!(until, now + DIAL_RETRY);
                    now = until;
                    assert_eq!(p.on(Event::Slept, now), Io::Connect);
                    dials += 1;
                }
                Io::Finished(Err(e)) => break e,
                io => panic!("{io:?}"),
            }
        };
        assert_eq!(err.reason, DIAL_FAILED);
        // At 0, 2, ..., 60 s.
        assert_eq!(dials, 31);
    }

    #[test]
    fn a_console_that_never_prompts_fails_the_dial_after_a_minute() {
        let mut now = Instant::now();
        let (mut p, _) = SacPass::start(plan(), now);
        p.on(Event::Connected, now);
        let mut nudges = 0;
        let err = loop {
            match p.on(Event::Written, now) {
                Io::Read { until } => {
                    assert!(until <= now + READ_DEADLINE);
                    p.on(Event::Read(b"garbage without a prompt\r\n".to_vec()), now);
                    now = until;
                    match p.on(Event::ReadTimeout, now) {
                        Io::Write(b) => {
                            assert_eq!(b, b"\r\n");
                            nudges += 1;
                        }
                        Io::Finished(Err(e)) => break e,
                        io => panic!("{io:?}"),
                    }
                }
                io => panic!("{io:?}"),
            }
        };
        assert_eq!(err.reason, DIAL_FAILED);
        assert_eq!(nudges, 11);
    }

    #[test]
    fn too_few_interfaces_after_sixty_listings_is_an_enum_failure() {
        let mut now = Instant::now();
        let (mut p, mut io) = to_first_command(&mut now);
        let mut listings = 0;
        let err = loop {
            match io {
                Io::Write(_) => io = p.on(Event::Written, now),
                Io::Read { until } if until == now + COMMAND_BUDGET => {
                    listings += 1;
                    io = p.on(Event::Read(b"Net: 10, Ip=1.2.3.4\r\nSAC>".to_vec()), now);
                }
                Io::Read { until } => {
                    now = until;
                    io = p.on(Event::ReadTimeout, now);
                }
                Io::Sleep { until } => {
                    now = until;
                    io = p.on(Event::Slept, now);
                }
                Io::Finished(Err(e)) => break e,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(err.reason, ENUM_FAILED);
        assert_eq!(listings, 60);
    }

    #[test]
    fn an_address_that_never_takes_fails_verification_after_ten_tries() {
        let mut now = Instant::now();
        let (mut p, mut io) = to_first_command(&mut now);
        let mut sets = 0;
        let err = loop {
            match io {
                Io::Write(b) => {
                    if b.starts_with(b"i 11 ") {
                        sets += 1;
                    }
                    io = p.on(Event::Written, now);
                }
                Io::Read { until } if until == now + COMMAND_BUDGET => {
                    io = p.on(
                        Event::Read(b"Net: 10, Ip=1.2.3.4\r\nNet: 11, Ip=9.9.9.9\r\nSAC>".to_vec()),
                        now,
                    );
                }
                Io::Read { until } => {
                    now = until;
                    io = p.on(Event::ReadTimeout, now);
                }
                Io::Sleep { until } => {
                    now = until;
                    io = p.on(Event::Slept, now);
                }
                Io::Finished(Err(e)) => break e,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(err.reason, VERIFY_FAILED);
        assert_eq!(sets, 10);
    }

    #[test]
    fn a_console_that_closes_during_the_set_is_a_set_failure() {
        let mut now = Instant::now();
        let (mut p, _) = to_first_command(&mut now);
        p.on(Event::Written, now);
        p.on(
            Event::Read(b"Net: 10, Ip=1.2.3.4\r\nNet: 11, Ip=9.9.9.9\r\nSAC>".to_vec()),
            now,
        );
        now += DISCARD_WINDOW;
        assert!(matches!(p.on(Event::ReadTimeout, now), Io::Write(_)));
        let io = p.on(Event::WriteFailed("broken pipe".into()), now);
        assert!(matches!(
            io,
            Io::Finished(Err(SacError {
                reason: SET_FAILED,
                ..
            }))
        ));
    }
}
