//! Many pod watches against one fake API server that restarts, as a fleet's nodes see it: with
//! its history each resumes without a relist; without its watch cache they relist spread out.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use mio::{Events, Poll, Token};
use vk_cocoon::kube::{Client, PodWatch, WatchConfig, WatchOutput};
use vk_cocoon::sandbox::apiserver::ApiServerHandle;

/// The node of the watch module's fake API server set-up, which this file shares.
const NODE: &str = "n1";

fn pod(name: &str) -> Pod {
    super::kube_watch::pod(name, NODE)
}

use super::kube_watch::setup;

/// `n` watches of the node's pods in one mio loop, each listed once and connected.
struct Watches {
    poll: Poll,
    watches: Vec<PodWatch>,
    /// Pod names each watch has seen Added (and not Deleted).
    seen: Vec<std::collections::BTreeSet<String>>,
}

impl Watches {
    fn start(n: usize, config: WatchConfig, client: &Client, api: &ApiServerHandle) -> Watches {
        let poll = Poll::new().unwrap();
        let mut ws = Watches {
            poll,
            watches: Vec::new(),
            seen: vec![Default::default(); n],
        };
        for i in 0..n {
            let mut w = PodWatch::new(NODE, config.clone());
            w.register(ws.poll.registry(), Token(i)).unwrap();
            let out = w.relist(client, Instant::now()).unwrap();
            ws.apply(i, out);
            ws.watches.push(w);
        }
        ws.run(client, Duration::from_secs(20), |ws| {
            api.open_watches() >= n && ws.watches.iter().all(PodWatch::connected)
        });
        assert!(api.open_watches() >= n, "every watch is connected");
        ws
    }

    fn apply(&mut self, i: usize, out: Vec<WatchOutput>) {
        for o in out {
            match o {
                WatchOutput::Added(p) | WatchOutput::Modified(p) => {
                    self.seen[i].insert(p.metadata.name.clone().unwrap_or_default());
                }
                WatchOutput::Deleted(p) => {
                    self.seen[i].remove(p.metadata.name.as_deref().unwrap_or_default());
                }
            }
        }
    }

    /// Drives every watch until `done` or `limit`; true when `done`.
    fn run(&mut self, client: &Client, limit: Duration, done: impl Fn(&Watches) -> bool) -> bool {
        self.run_observing(client, limit, done, |_, _| {})
    }

    /// As `run`, calling `tick(i, watch)` after each turn of watch `i`.
    fn run_observing(
        &mut self,
        client: &Client,
        limit: Duration,
        done: impl Fn(&Watches) -> bool,
        mut tick: impl FnMut(usize, &PodWatch),
    ) -> bool {
        let mut events = Events::with_capacity(64);
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if done(self) {
                return true;
            }
            self.poll
                .poll(&mut events, Some(Duration::from_millis(10)))
                .unwrap();
            let ready: Vec<usize> = events.iter().map(|e| e.token().0).collect();
            let now = Instant::now();
            for i in 0..self.watches.len() {
                let mut out = Vec::new();
                if ready.contains(&i) || self.watches[i].read_more() {
                    out.extend(self.watches[i].on_ready(client, now));
                }
                if self.watches[i].next_due().is_some_and(|d| d <= now) {
                    out.extend(self.watches[i].on_timer(client, now));
                }
                self.apply(i, out);
                tick(i, &self.watches[i]);
            }
        }
        done(self)
    }
}

#[test]
fn a_restart_that_keeps_the_data_resumes_every_watch_without_a_relist() {
    let (api, _dir, client) = setup();
    for i in 0..3 {
        api.create_pod(&pod(&format!("before-{i}"))).unwrap();
    }
    let config = WatchConfig {
        backoff_initial: Duration::from_millis(50),
        backoff_max: Duration::from_millis(400),
        ..WatchConfig::default()
    };
    let mut ws = Watches::start(8, config, &client, &api);
    let versions: Vec<u64> = ws
        .watches
        .iter()
        .map(|w| w.resource_version().parse().unwrap())
        .collect();
    api.clear_requests();

    api.stop();
    // Down for a while: each watch sees its stream cut and its reconnects refused.
    ws.run(&client, Duration::from_millis(1200), |_| false);
    assert_eq!(api.open_watches(), 0);
    api.create_pod(&pod("while-down")).unwrap();
    api.restart().unwrap();

    let all_seen = ws.run(&client, Duration::from_secs(20), |ws| {
        ws.seen.iter().all(|s| s.contains("while-down"))
    });
    assert!(
        all_seen,
        "every watch delivered the pod created while the server was down"
    );
    for (i, w) in ws.watches.iter().enumerate() {
        assert_eq!(
            w.stats.relists, 1,
            "watch {i} only listed at the start: {:?}",
            w.stats
        );
        assert!(
            w.stats.connects >= 2,
            "watch {i} reconnected: {:?}",
            w.stats
        );
    }
    let requests = api.requests();
    assert!(
        !requests.iter().any(|r| r.verb == "list"),
        "no relist after the restart: {:?}",
        requests.iter().map(|r| &r.verb).collect::<Vec<_>>()
    );
    // Each reconnect named a version no older than what its watch had seen before the stop.
    let resumed: Vec<u64> = requests
        .iter()
        .filter(|r| r.verb == "watch" && r.status == 200)
        .filter_map(|r| {
            r.query
                .iter()
                .find(|(k, _)| k == "resourceVersion")
                .and_then(|(_, v)| v.parse().ok())
        })
        .collect();
    assert!(resumed.len() >= ws.watches.len(), "{resumed:?}");
    let oldest = versions.iter().min().copied().unwrap_or(0);
    assert!(
        resumed.iter().all(|rv| *rv >= oldest),
        "resumed from {resumed:?}, before the stop at {versions:?}"
    );
}

#[test]
fn a_lost_watch_cache_makes_a_fleet_of_watches_relist_spread_out() {
    let (api, _dir, client) = setup();
    api.create_pod(&pod("p")).unwrap();
    let n = 20;
    let spread = Duration::from_secs(2);
    let config = WatchConfig {
        backoff_initial: Duration::from_millis(100),
        backoff_max: Duration::from_millis(400),
        relist_spread: spread,
        ..WatchConfig::default()
    };
    let mut ws = Watches::start(n, config, &client, &api);
    api.restart_losing_watch_cache(|| std::thread::sleep(Duration::from_millis(300)))
        .unwrap();
    let back = Instant::now();
    let mut relisted: Vec<Option<Instant>> = vec![None; n];
    let done = ws.run_observing(
        &client,
        Duration::from_secs(30),
        |ws| ws.watches.iter().all(|w| w.stats.relists >= 2),
        |i, w| {
            if w.stats.relists >= 2 && relisted[i].is_none() {
                relisted[i] = Some(Instant::now());
            }
        },
    );
    assert!(done, "every watch relisted after its 410");
    let mut at: Vec<f64> = relisted
        .iter()
        .flatten()
        .map(|t| t.duration_since(back).as_secs_f64())
        .collect();
    at.sort_by(f64::total_cmp);
    // Without the spread, the watches relist as they reconnect: all within a few hundred ms.
    let span = at[n - 1] - at[0];
    assert!(span >= 1.0, "relists spread over {span:.2} s: {at:?}");
    let crowded = (0..n)
        .map(|k| at[k..].iter().take_while(|t| **t < at[k] + 0.25).count())
        .max()
        .unwrap_or(0);
    assert!(
        crowded * 5 <= n * 2,
        "{crowded} of {n} watches relisted within 250 ms: {at:?}"
    );
    // A failure bound for a loaded host (the 20 relists are blocking calls of this one thread).
    assert!(
        at[n - 1] < spread.as_secs_f64() + 15.0,
        "the last relist waited about the spread and a reconnect: {at:?}"
    );
    for (i, w) in ws.watches.iter().enumerate() {
        assert_eq!(w.stats.relists, 2, "watch {i}: {:?}", w.stats);
    }
}
