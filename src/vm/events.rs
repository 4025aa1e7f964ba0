//! The VM event stream: line splitting and parsing of `vm status --event --format json`, and the
//! restart/back-off state machine of its child. Pure: callers pass `now` and run the child.

use super::types::{EventKind, EventLine, VmEvent};
use std::fmt;
use std::time::{Duration, Instant};

/// Longest accepted event line (behaviour 11.1).
pub const MAX_EVENT_LINE: usize = 1 << 20;

/// Why one line was skipped. The caller logs it and carries on with the next line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventLineError {
    /// Longer than [`MAX_EVENT_LINE`]; its bytes were discarded.
    TooLong(usize),
    /// Not an event object.
    Undecodable(String),
}

impl fmt::Display for EventLineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventLineError::TooLong(n) => write!(f, "event line too long ({n} bytes), skipped"),
            EventLineError::Undecodable(why) => write!(f, "undecodable event line skipped: {why}"),
        }
    }
}

impl std::error::Error for EventLineError {}

/// Parses one line. `Ok(None)` for blank lines and for events whose VM has neither id nor name.
pub fn parse_event_line(line: &[u8]) -> Result<Option<VmEvent>, EventLineError> {
    if line.len() > MAX_EVENT_LINE {
        return Err(EventLineError::TooLong(line.len()));
    }
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let wire: EventLine =
        serde_json::from_slice(line).map_err(|e| EventLineError::Undecodable(e.to_string()))?;
    if wire.event.is_empty() {
        return Err(EventLineError::Undecodable("missing event kind".into()));
    }
    if wire.vm.id.is_empty() && wire.vm.config.name.is_empty() {
        return Ok(None);
    }
    Ok(Some(VmEvent {
        kind: EventKind::parse(&wire.event),
        vm: wire.vm,
    }))
}

/// Splits a byte stream into lines with a bounded buffer: an overlong line is dropped (and
/// reported once) instead of growing memory without limit.
#[derive(Debug, Default)]
pub struct LineSplitter {
    buf: Vec<u8>,
    /// Bytes of the current overlong line discarded so far (0 = not discarding).
    discarding: usize,
}

/// One item out of [`LineSplitter`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SplitItem {
    Line(Vec<u8>),
    /// A line longer than the limit was dropped; its length so far.
    Overlong(usize),
}

impl LineSplitter {
    pub fn new() -> LineSplitter {
        LineSplitter::default()
    }

    /// Feeds a chunk; returns the complete lines it finished (without the newline).
    pub fn push(&mut self, mut chunk: &[u8]) -> Vec<SplitItem> {
        let mut items = Vec::new();
        while !chunk.is_empty() {
            let nl = chunk.iter().position(|b| *b == b'\n');
            let (head, rest, complete) = match nl {
                Some(i) => (&chunk[..i], &chunk[i + 1..], true),
                None => (chunk, &chunk[chunk.len()..], false),
            };
            if self.discarding > 0 {
                self.discarding += head.len();
                if complete {
                    items.push(SplitItem::Overlong(self.discarding));
                    self.discarding = 0;
                }
            } else if self.buf.len() + head.len() > MAX_EVENT_LINE {
                self.discarding = self.buf.len() + head.len();
                self.buf.clear();
                if complete {
                    items.push(SplitItem::Overlong(self.discarding));
                    self.discarding = 0;
                }
            } else {
                self.buf.extend_from_slice(head);
                if complete {
                    items.push(SplitItem::Line(std::mem::take(&mut self.buf)));
                }
            }
            chunk = rest;
        }
        items
    }

    /// At EOF: the unterminated last line, if any (a stream that died mid-line yields it here).
    pub fn finish(&mut self) -> Option<SplitItem> {
        self.discarding = 0;
        if self.buf.is_empty() {
            None
        } else {
            Some(SplitItem::Line(std::mem::take(&mut self.buf)))
        }
    }
}

/// Parses split items into events; errors are the lines to log and skip.
pub fn parse_items(items: Vec<SplitItem>) -> Vec<Result<VmEvent, EventLineError>> {
    items
        .into_iter()
        .filter_map(|item| match item {
            SplitItem::Line(l) => parse_event_line(&l).transpose(),
            SplitItem::Overlong(n) => Some(Err(EventLineError::TooLong(n))),
        })
        .collect()
}

/// First restart delay after a failure.
pub const BACKOFF_MIN: Duration = Duration::from_secs(1);
/// Ceiling of the doubling back-off.
pub const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// Fixed delay after a clean stream end (exit 0).
pub const CLEAN_RESTART_DELAY: Duration = Duration::from_secs(2);
/// A child that lived this long counts as a successful connect even without output
/// (an empty host emits no lines).
pub const STABLE_AFTER: Duration = Duration::from_secs(10);

/// Where the event-stream child is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamPhase {
    /// Nothing running; spawn when asked (`next_start` is the earliest moment).
    Down { next_start: Instant },
    /// Child running since `since`; `connected` once it proved itself.
    Up { since: Instant, connected: bool },
}

/// What the loop should do about the stream right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamAction {
    /// Spawn the child now.
    Spawn,
    /// Arm a timer and ask again at this instant.
    WaitUntil(Instant),
    /// The child is running; nothing to do.
    Running,
}

/// Restart policy of the event-stream child (behaviour 11.1): start failure or abnormal exit ⇒
/// 1 s doubling to 60 s, reset after a successful connect; clean exit ⇒ fixed 2 s. After any
/// restart a re-sync `vm list` is owed because events during the gap were lost.
#[derive(Debug, Clone)]
pub struct EventStreamSupervisor {
    phase: StreamPhase,
    backoff: Duration,
    starts: u64,
    resync_owed: bool,
    /// Whether a restart has happened (the first start needs no re-sync: startup reconcile lists).
    restarted: bool,
}

impl EventStreamSupervisor {
    /// A supervisor that wants to spawn immediately.
    pub fn new(now: Instant) -> EventStreamSupervisor {
        EventStreamSupervisor {
            phase: StreamPhase::Down { next_start: now },
            backoff: BACKOFF_MIN,
            starts: 0,
            resync_owed: false,
            restarted: false,
        }
    }

    pub fn phase(&self) -> StreamPhase {
        self.phase
    }

    /// The delay the next failure will wait.
    pub fn current_backoff(&self) -> Duration {
        self.backoff
    }

    /// Number of successful spawns so far.
    pub fn starts(&self) -> u64 {
        self.starts
    }

    /// What to do now.
    pub fn poll(&self, now: Instant) -> StreamAction {
        match self.phase {
            StreamPhase::Up { .. } => StreamAction::Running,
            StreamPhase::Down { next_start } if now >= next_start => StreamAction::Spawn,
            StreamPhase::Down { next_start } => StreamAction::WaitUntil(next_start),
        }
    }

    /// The child was spawned.
    pub fn on_spawned(&mut self, now: Instant) {
        self.phase = StreamPhase::Up {
            since: now,
            connected: false,
        };
        self.starts += 1;
        if self.restarted {
            self.resync_owed = true;
        }
    }

    /// Spawning failed; returns when to try again.
    pub fn on_spawn_failed(&mut self, now: Instant) -> Instant {
        self.restarted = true;
        self.fail(now)
    }

    /// A line arrived: the stream is connected, so the back-off resets.
    pub fn on_line(&mut self, _now: Instant) {
        if let StreamPhase::Up { since, .. } = self.phase {
            self.phase = StreamPhase::Up {
                since,
                connected: true,
            };
            self.backoff = BACKOFF_MIN;
        }
    }

    /// The child ended; `clean` = exit status 0. Returns when to restart.
    pub fn on_exit(&mut self, now: Instant, clean: bool) -> Instant {
        self.restarted = true;
        if let StreamPhase::Up { since, connected } = self.phase {
            if connected || now.saturating_duration_since(since) >= STABLE_AFTER {
                self.backoff = BACKOFF_MIN;
            }
        }
        if clean {
            let at = now + CLEAN_RESTART_DELAY;
            self.phase = StreamPhase::Down { next_start: at };
            at
        } else {
            self.fail(now)
        }
    }

    fn fail(&mut self, now: Instant) -> Instant {
        let at = now + self.backoff;
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        self.phase = StreamPhase::Down { next_start: at };
        at
    }

    /// True once after a restart: run a `vm list` and diff it against tracked VMs.
    pub fn take_resync(&mut self) -> bool {
        std::mem::take(&mut self.resync_owed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_event_line_parses() {
        let line = br#"{"event":"MODIFIED","vm":{"id":"Q3MZ5T2XKJ7A4LW6PDNB2RVHEY","hypervisor":"cloud-hypervisor","state":"stopped (stale)","config":{"cpu":2,"memory":4294967296,"name":"vk-ns-demo-0"},"pid":0,"socket_path":"/var/lib/cocoon/run/cloudhypervisor/Q3MZ5T2XKJ7A4LW6PDNB2RVHEY/api.sock","first_booted":true,"created_at":"2026-04-27T11:37:00Z","updated_at":"2026-04-27T11:37:02Z"}}"#;
        let ev = parse_event_line(line).unwrap().unwrap();
        assert_eq!(ev.kind, EventKind::Modified);
        assert_eq!(ev.vm.id, "Q3MZ5T2XKJ7A4LW6PDNB2RVHEY");
        assert_eq!(
            ev.vm.state_kind(),
            super::super::types::VmState::StoppedStale
        );
        assert_eq!(ev.vm.config.memory, 4_294_967_296);
    }

    #[test]
    fn blank_nameless_and_garbage_lines() {
        assert_eq!(parse_event_line(b"   \r"), Ok(None));
        assert_eq!(
            parse_event_line(br#"{"event":"ADDED","vm":{"state":"running"}}"#),
            Ok(None)
        );
        let named = parse_event_line(br#"{"event":"DELETED","vm":{"config":{"name":"a"}}}"#);
        assert_eq!(named.unwrap().unwrap().kind, EventKind::Deleted);
        assert!(matches!(
            parse_event_line(b"garbage{"),
            Err(EventLineError::Undecodable(_))
        ));
        assert!(matches!(
            parse_event_line(br#"{"vm":{"id":"x"}}"#),
            Err(EventLineError::Undecodable(_))
        ));
        assert!(matches!(
            parse_event_line(b"[1,2]"),
            Err(EventLineError::Undecodable(_))
        ));
    }

    #[test]
    fn splitter_handles_chunks_and_overlong_lines() {
        let mut s = LineSplitter::new();
        assert!(s.push(b"ab").is_empty());
        assert_eq!(
            s.push(b"c\nde\n\nf"),
            vec![
                SplitItem::Line(b"abc".to_vec()),
                SplitItem::Line(b"de".to_vec()),
                SplitItem::Line(Vec::new())
            ]
        );
        assert_eq!(s.finish(), Some(SplitItem::Line(b"f".to_vec())));
        let big = vec![b'x'; MAX_EVENT_LINE + 10];
        assert!(s.push(&big[..MAX_EVENT_LINE]).is_empty());
        assert!(s.push(&big[MAX_EVENT_LINE..]).is_empty());
        let out = s.push(b"yy\nok\n");
        assert_eq!(
            out,
            vec![
                SplitItem::Overlong(MAX_EVENT_LINE + 12),
                SplitItem::Line(b"ok".to_vec())
            ]
        );
        assert!(s.buf.capacity() <= MAX_EVENT_LINE * 2);
    }

    #[test]
    fn backoff_doubles_caps_and_resets() {
        let t0 = Instant::now();
        let mut s = EventStreamSupervisor::new(t0);
        assert_eq!(s.poll(t0), StreamAction::Spawn);
        let mut now = t0;
        let mut delays = Vec::new();
        for _ in 0..8 {
            let at = s.on_spawn_failed(now);
            delays.push((at - now).as_secs());
            assert_eq!(s.poll(now), StreamAction::WaitUntil(at));
            now = at;
            assert_eq!(s.poll(now), StreamAction::Spawn);
        }
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 32, 60, 60]);
        // Abnormal exit right after start keeps backing off.
        s.on_spawned(now);
        assert!(s.take_resync());
        assert!(!s.take_resync());
        let at = s.on_exit(now + Duration::from_millis(5), false);
        assert_eq!(
            at - (now + Duration::from_millis(5)),
            Duration::from_secs(60)
        );
        // A connect (first line) resets the back-off.
        now = at;
        s.on_spawned(now);
        s.on_line(now);
        let at = s.on_exit(now, false);
        assert_eq!(at - now, Duration::from_secs(1));
        now = at;
        s.on_spawned(now);
        let at = s.on_exit(now, false);
        assert_eq!(at - now, Duration::from_secs(2));
    }

    #[test]
    fn clean_exit_waits_two_seconds_and_long_life_counts_as_connected() {
        let t0 = Instant::now();
        let mut s = EventStreamSupervisor::new(t0);
        s.on_spawned(t0);
        assert!(!s.take_resync(), "first start needs no resync");
        let at = s.on_exit(t0, true);
        assert_eq!(at - t0, CLEAN_RESTART_DELAY);
        assert_eq!(
            s.poll(at - Duration::from_millis(1)),
            StreamAction::WaitUntil(at)
        );
        s.on_spawned(at);
        assert!(s.take_resync());
        for _ in 0..3 {
            s.on_spawn_failed(at);
        }
        assert_eq!(s.current_backoff(), Duration::from_secs(8));
        s.on_spawned(at);
        let later = at + STABLE_AFTER;
        let next = s.on_exit(later, false);
        assert_eq!(next - later, BACKOFF_MIN);
    }
}
