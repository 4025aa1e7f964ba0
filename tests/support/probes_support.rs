//! Test support shared by the network and probe tests: throw-away network namespaces, a
//! re-exec of the test binary inside one (optionally without CAP_NET_RAW), and a small
//! reactor-style loop (mio poll, timer heap, clock read once per wake-up) that drives a
//! ProbeEngine exactly as the daemon's loop does.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::process::{Command, Output};
use std::time::{Duration, Instant, SystemTime};

use vk_cocoon::probes::{ProbeEngine, ProbeEvent, ProbeHost, TimerKey};

/// Environment variable that marks a re-executed child.
pub const CHILD_ENV: &str = "VK_PROBES_TEST_CHILD";

fn run(argv: &[&str]) -> Result<(), String> {
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .map_err(|e| format!("{}: {e}", argv.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} failed: {}",
            argv.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A network namespace created for one test and deleted when dropped.
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// Create `vkp<pid><tag>` with loopback up, or print why not and return None (not root,
    /// no `ip`, no netns support).
    pub fn create(tag: &str) -> Option<Netns> {
        let name = format!("vkp{}{}", std::process::id(), tag);
        let _ = run(&["ip", "netns", "del", &name]);
        if let Err(e) = run(&["ip", "netns", "add", &name]) {
            println!("SKIP: cannot create a network namespace (needs root and iproute2): {e}");
            return None;
        }
        let ns = Netns { name };
        if let Err(e) = ns.ip(&["link", "set", "lo", "up"]) {
            println!("SKIP: cannot bring up loopback in {}: {e}", ns.name);
            return None;
        }
        Some(ns)
    }

    /// `ip -n <ns> <args…>`
    pub fn ip(&self, args: &[&str]) -> Result<(), String> {
        let mut argv = vec!["ip", "-n", self.name.as_str()];
        argv.extend_from_slice(args);
        run(&argv)
    }

    /// Run the test named `test` (its full name in the test binary, `module::test`) of the
    /// current test binary inside this namespace, with `env` set, optionally stripped of
    /// CAP_NET_RAW through setpriv. Returns the output.
    pub fn run_child(&self, test: &str, drop_net_raw: bool, env: &[(&str, &str)]) -> Output {
        let exe = std::env::current_exe().expect("test binary path");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]);
        if drop_net_raw {
            cmd.args([
                "setpriv",
                "--inh-caps=-all",
                "--bounding-set=-net_raw",
                "--",
            ]);
        }
        cmd.arg(exe)
            .args([
                "--exact",
                test,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("run child test");
        println!(
            "--- child {test} ---\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
        out
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run(&["ip", "netns", "del", &self.name]);
    }
}

/// Two namespaces joined by a veth pair: `probe` (10.77.0.1/24 on `vp`) and `guest`
/// (10.77.0.2/24 on `vg`). Traffic to 10.77.0.2 from `probe` stays inside the pair.
pub struct VethPair {
    pub probe: Netns,
    pub guest: Netns,
}

pub const PROBE_SIDE: &str = "10.77.0.1";
pub const GUEST_SIDE: &str = "10.77.0.2";

impl VethPair {
    pub fn create() -> Option<VethPair> {
        let probe = Netns::create("p")?;
        let guest = Netns::create("g")?;
        let steps: [&[&str]; 3] = [
            &[
                "link",
                "add",
                "vp",
                "type",
                "veth",
                "peer",
                "name",
                "vg",
                "netns",
                &guest.name,
            ],
            &["addr", "add", "10.77.0.1/24", "dev", "vp"],
            &["link", "set", "vp", "up"],
        ];
        for step in steps {
            if let Err(e) = probe.ip(step) {
                println!("SKIP: cannot set up a veth pair: {e}");
                return None;
            }
        }
        for step in [
            &["addr", "add", "10.77.0.2/24", "dev", "vg"][..],
            &["link", "set", "vg", "up"],
        ] {
            if let Err(e) = guest.ip(step) {
                println!("SKIP: cannot set up a veth pair: {e}");
                return None;
            }
        }
        Some(VethPair { probe, guest })
    }

    pub fn set_guest_link(&self, up: bool) {
        self.guest
            .ip(&["link", "set", "vg", if up { "up" } else { "down" }])
            .expect("set guest link");
    }
}

/// True in a re-executed child; otherwise prints that the helper only runs as a child.
pub fn is_child(test: &str) -> bool {
    if std::env::var_os(CHILD_ENV).is_some() {
        true
    } else {
        println!("{test} is a helper run by its parent test inside a namespace; nothing to do");
        false
    }
}

/// A minimal reactor: mio poll, a timer heap, and the clock read once per wake-up.
pub struct TestLoop {
    pub poll: mio::Poll,
    next_token: usize,
    next_timer: u64,
    timers: BTreeMap<(Instant, u64), TimerKey>,
    pub wakeups: u64,
}

impl ProbeHost for TestLoop {
    type TimerId = (Instant, u64);

    fn registry(&self) -> &mio::Registry {
        self.poll.registry()
    }

    fn new_token(&mut self) -> mio::Token {
        self.next_token += 1;
        mio::Token(self.next_token)
    }

    fn timer_at(&mut self, at: Instant, key: TimerKey) -> (Instant, u64) {
        self.next_timer += 1;
        self.timers.insert((at, self.next_timer), key);
        (at, self.next_timer)
    }

    fn cancel_timer(&mut self, id: (Instant, u64)) {
        self.timers.remove(&id);
    }
}

impl TestLoop {
    pub fn new() -> TestLoop {
        TestLoop {
            poll: mio::Poll::new().expect("poll"),
            next_token: 0,
            next_timer: 0,
            timers: BTreeMap::new(),
            wakeups: 0,
        }
    }

    pub fn armed(&self) -> usize {
        self.timers.len()
    }

    /// Run until `until` or until `stop` returns true. `stop` sees each provider event with
    /// the loop's clock reading of the wake-up that produced it, and `None` once after every
    /// wake-up (to inspect the engine's stored results).
    pub fn run<T: Copy>(
        &mut self,
        engine: &mut ProbeEngine<T>,
        until: Instant,
        mut stop: impl FnMut(Instant, Option<&ProbeEvent>, &ProbeEngine<T>) -> bool,
    ) -> bool
    where
        TestLoop: ProbeHost<TimerId = T>,
    {
        let mut events = mio::Events::with_capacity(1024);
        loop {
            let now = Instant::now();
            if now >= until {
                return false;
            }
            let next = self
                .timers
                .keys()
                .next()
                .map(|(at, _)| *at)
                .unwrap_or(until)
                .min(until);
            let timeout = next.saturating_duration_since(now);
            // Round up: epoll has millisecond resolution; waking early would only spin.
            let timeout = Duration::from_millis(timeout.as_millis() as u64 + 1);
            self.poll.poll(&mut events, Some(timeout)).expect("poll");
            self.wakeups += 1;
            let now = Instant::now();
            let mut out = Vec::new();
            for ev in events.iter() {
                if engine.owns_token(ev.token()) {
                    out.extend(engine.on_io(self, ev.token(), now));
                }
            }
            while let Some((&(at, n), &key)) = self.timers.iter().next() {
                if at > now {
                    break;
                }
                self.timers.remove(&(at, n));
                out.extend(engine.on_timer(self, key, now, SystemTime::now()));
            }
            for ev in &out {
                if stop(now, Some(ev), engine) {
                    return true;
                }
            }
            if stop(now, None, engine) {
                return true;
            }
        }
    }
}
