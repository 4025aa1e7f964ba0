//! The non-blocking pod watch in a real mio loop against the fake API server: bursts of pod
//! changes while watches are cut every second, a 410 in the middle, and pods deleted while the
//! watch is down; the watch's view must end identical to the server's, each change once, in order.

use crate::load_support;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use mio::{Events, Poll, Token};
use vk_cocoon::kube::{Client, KubeOptions, PodWatch, WatchConfig, WatchOutput};
use vk_cocoon::sandbox::apiserver::{
    ApiServer, ApiServerHandle, ApiServerOptions, Fault, FaultMatch, KubeconfigAuth,
};

const NODE: &str = "n1";
const WATCH: Token = Token(7);

pub(crate) fn pod(name: &str, node: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "img"}]}
    }))
    .unwrap()
}

pub(crate) fn setup() -> (ApiServerHandle, tempfile::TempDir, Client) {
    let api = ApiServer::start(ApiServerOptions {
        bookmark_interval: Duration::from_millis(300),
        ..ApiServerOptions::default()
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kc = dir.path().join("kubeconfig");
    api.write_kubeconfig(
        &kc,
        &KubeconfigAuth::ClientCert {
            user: "system:node:n1".into(),
            groups: vec!["system:nodes".into()],
        },
    )
    .unwrap();
    let client = Client::from_env(&KubeOptions {
        kubeconfig: Some(kc.to_string_lossy().into_owned()),
        timeout: Duration::from_secs(5),
        qps: 0.0,
        ..KubeOptions::default()
    })
    .unwrap();
    (api, dir, client)
}

fn rv(p: &Pod) -> u64 {
    p.metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn uid(p: &Pod) -> String {
    p.metadata.uid.clone().unwrap_or_default()
}

fn key(p: &Pod) -> String {
    format!(
        "{}/{}",
        p.metadata.namespace.as_deref().unwrap_or(""),
        p.metadata.name.as_deref().unwrap_or("")
    )
}

/// What the daemon would hold, plus every delivery per UID for the ordering checks.
#[derive(Default)]
struct View {
    pods: HashMap<String, (String, u64)>,
    deliveries: HashMap<String, Vec<(char, u64)>>,
}

impl View {
    fn apply(&mut self, outs: Vec<WatchOutput>) {
        for o in outs {
            let (c, p) = match o {
                WatchOutput::Added(p) => ('A', p),
                WatchOutput::Modified(p) => ('M', p),
                WatchOutput::Deleted(p) => ('D', p),
            };
            self.deliveries
                .entry(uid(&p))
                .or_default()
                .push((c, rv(&p)));
            match c {
                'D' => {
                    let held = self.pods.remove(&key(&p));
                    assert_eq!(
                        held.map(|h| h.0),
                        Some(uid(&p)),
                        "Deleted for the incarnation held"
                    );
                }
                'A' => {
                    assert!(
                        !self.pods.contains_key(&key(&p)),
                        "Added while another incarnation is held: {}",
                        key(&p)
                    );
                    self.pods.insert(key(&p), (uid(&p), rv(&p)));
                }
                _ => {
                    let held = self.pods.get(&key(&p)).map(|h| h.0.clone());
                    assert_eq!(held, Some(uid(&p)), "Modified for the incarnation held");
                    self.pods.insert(key(&p), (uid(&p), rv(&p)));
                }
            }
        }
    }
}

fn server_view(api: &ApiServerHandle) -> HashMap<String, (String, u64)> {
    api.pods()
        .into_iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(NODE))
        .map(|p| (key(&p), (uid(&p), rv(&p))))
        .collect()
}

/// Run the loop until `done()` and the view matches the server, or the deadline passes.
fn run_loop(
    poll: &mut Poll,
    w: &mut PodWatch,
    client: &Client,
    view: &mut View,
    api: &ApiServerHandle,
    done: &dyn Fn() -> bool,
    deadline: Duration,
) -> bool {
    let mut events = Events::with_capacity(64);
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        let now = Instant::now();
        let wait = w
            .next_due()
            .map(|d| d.saturating_duration_since(now))
            .unwrap_or(Duration::from_millis(50));
        poll.poll(&mut events, Some(wait.min(Duration::from_millis(50))))
            .unwrap();
        let now = Instant::now();
        for e in events.iter() {
            if e.token() == WATCH {
                view.apply(w.on_ready(client, now));
            }
        }
        if w.next_due().is_some_and(|d| d <= now) {
            view.apply(w.on_timer(client, now));
        }
        if done() && view.pods == server_view(api) {
            return true;
        }
    }
    false
}

#[test]
fn five_hundred_pods_with_drops_and_410_converge() {
    let (api, _dir, client) = setup();
    for i in 0..20 {
        api.create_pod(&pod(&format!("pre-{i}"), NODE)).unwrap();
    }
    let mut poll = Poll::new().unwrap();
    let mut w = PodWatch::new(
        NODE,
        WatchConfig {
            backoff_initial: Duration::from_millis(20),
            backoff_max: Duration::from_millis(300),
            // One watch, not a fleet: relist soon after a 410.
            relist_spread: Duration::from_millis(50),
            ..WatchConfig::default()
        },
    );
    w.register(poll.registry(), WATCH).unwrap();
    let mut view = View::default();
    view.apply(w.relist(&client, Instant::now()).unwrap());
    assert_eq!(view.pods.len(), 20);
    api.drop_watches_every(Some(Duration::from_secs(1)));

    let finished = Arc::new(AtomicBool::new(false));
    let deleted: Arc<Mutex<HashSet<String>>> = Arc::default();
    let mutator = {
        let api = api.clone();
        let finished = finished.clone();
        let deleted = deleted.clone();
        std::thread::spawn(move || {
            let mut n = 0;
            for burst in 0..5 {
                // 100 new pods per burst (some on another node), each updated twice.
                let names: Vec<String> = (0..100).map(|i| format!("b{burst}-{i}")).collect();
                for (i, name) in names.iter().enumerate() {
                    let node = if i % 10 == 9 { "other" } else { NODE };
                    api.create_pod(&pod(name, node)).unwrap();
                    n += 1;
                }
                for round in 0..2 {
                    for name in &names {
                        api.edit_object("pods", "default", name, |v| {
                            v["metadata"]["annotations"]["round"] = format!("{round}").into();
                        })
                        .unwrap();
                    }
                }
                // Delete a third; recreate some of those under the same name (new UID).
                for name in names.iter().step_by(3) {
                    let p = api.delete_pod("default", name, Some(0)).unwrap();
                    deleted.lock().unwrap().insert(uid(&p));
                }
                for name in names.iter().step_by(9) {
                    api.create_pod(&pod(name, NODE)).unwrap();
                }
                if burst == 2 {
                    // The watch goes down (500s), pods are deleted meanwhile, history is compacted:
                    // the next watch gets 410 and only a relist can reveal those deletions.
                    api.fail_next(40, FaultMatch::new("watch", "pods"), Fault::InternalError);
                    api.drop_watches();
                    std::thread::sleep(Duration::from_millis(100));
                    for i in (1..100).step_by(3).take(10) {
                        let name = format!("b1-{i}");
                        if let Ok(p) = api.delete_pod("default", &name, Some(0)) {
                            deleted.lock().unwrap().insert(uid(&p));
                        }
                    }
                    api.compact_history();
                    api.clear_faults();
                    api.drop_watches_every(Some(Duration::from_secs(1)));
                }
                std::thread::sleep(Duration::from_millis(300));
            }
            assert_eq!(n, 500);
            finished.store(true, Ordering::SeqCst);
        })
    };
    let done = || finished.load(Ordering::SeqCst);
    let converged = run_loop(
        &mut poll,
        &mut w,
        &client,
        &mut view,
        &api,
        &done,
        Duration::from_secs(60),
    );
    mutator.join().unwrap();
    assert!(
        converged,
        "view never matched the server: {} held vs {} on server",
        view.pods.len(),
        server_view(&api).len()
    );

    // Every incarnation: one Added first, strictly increasing resourceVersions, Deleted last.
    for (u, d) in &view.deliveries {
        assert_eq!(d[0].0, 'A', "{u}: first delivery is Added: {d:?}");
        assert_eq!(d.iter().filter(|x| x.0 == 'A').count(), 1, "{u}: {d:?}");
        assert!(d.iter().filter(|x| x.0 == 'D').count() <= 1, "{u}: {d:?}");
        if let Some(pos) = d.iter().position(|x| x.0 == 'D') {
            assert_eq!(pos, d.len() - 1, "{u}: Deleted is last: {d:?}");
        }
        for pair in d.windows(2) {
            assert!(
                pair[1].1 > pair[0].1 || pair[1].0 == 'D',
                "{u}: in order, once each: {d:?}"
            );
        }
    }
    // Every deleted incarnation that was ever delivered was delivered as Deleted.
    for u in deleted.lock().unwrap().iter() {
        if let Some(d) = view.deliveries.get(u) {
            assert_eq!(
                d.last().map(|x| x.0),
                Some('D'),
                "{u} deleted on the server: {d:?}"
            );
        }
    }
    assert!(
        w.stats.relists >= 2,
        "the 410 forced a relist: {:?}",
        w.stats
    );
    assert!(
        w.stats.connects >= 4,
        "watches were cut and resumed: {:?}",
        w.stats
    );
    assert_eq!(w.stats.bad_lines, 0);
}

#[test]
fn error_event_410_and_http_410_both_relist() {
    let (api, _dir, client) = setup();
    let mut poll = Poll::new().unwrap();
    let mut w = PodWatch::new(
        NODE,
        WatchConfig {
            backoff_initial: Duration::from_millis(10),
            relist_spread: Duration::from_millis(50),
            ..WatchConfig::default()
        },
    );
    w.register(poll.registry(), WATCH).unwrap();
    let mut view = View::default();
    view.apply(w.relist(&client, Instant::now()).unwrap());
    api.fail_next(1, FaultMatch::new("watch", "pods"), Fault::GoneEvent);
    api.create_pod(&pod("a", NODE)).unwrap();
    let one = || true;
    assert!(run_loop(
        &mut poll,
        &mut w,
        &client,
        &mut view,
        &api,
        &one,
        Duration::from_secs(10)
    ));
    assert_eq!(w.stats.relists, 2, "{:?}", w.stats);
    api.fail_next(1, FaultMatch::new("watch", "pods"), Fault::Gone);
    api.drop_watches();
    api.create_pod(&pod("b", NODE)).unwrap();
    assert!(run_loop(
        &mut poll,
        &mut w,
        &client,
        &mut view,
        &api,
        &one,
        Duration::from_secs(10)
    ));
    let t = Instant::now();
    while w.stats.relists < 3 && t.elapsed() < Duration::from_secs(5) {
        run_loop(
            &mut poll,
            &mut w,
            &client,
            &mut view,
            &api,
            &one,
            Duration::from_millis(100),
        );
    }
    assert_eq!(w.stats.relists, 3, "{:?}", w.stats);
    assert_eq!(view.pods.len(), 2);
}

#[test]
fn stalled_server_does_not_block_the_loop() {
    let (api, _dir, client) = setup();
    let mut poll = Poll::new().unwrap();
    let mut w = PodWatch::new(
        NODE,
        WatchConfig {
            connect_timeout: Duration::from_millis(300),
            backoff_initial: Duration::from_millis(10),
            ..WatchConfig::default()
        },
    );
    w.register(poll.registry(), WATCH).unwrap();
    let mut view = View::default();
    view.apply(w.relist(&client, Instant::now()).unwrap());
    // Every request now waits 2 s before an answer: the watch head does not arrive in time.
    api.set_latency(Duration::from_secs(2));
    let mut events = Events::with_capacity(8);
    let load = load_support::WakeupProbe::start();
    let start = Instant::now();
    let mut longest = Duration::ZERO;
    while start.elapsed() < Duration::from_millis(900) {
        poll.poll(&mut events, Some(Duration::from_millis(20)))
            .unwrap();
        let t = Instant::now();
        for e in events.iter() {
            if e.token() == WATCH {
                view.apply(w.on_ready(&client, t));
            }
        }
        if w.next_due().is_some_and(|d| d <= t) {
            // on_timer may reconnect (non-blocking) but must not wait for the slow server.
            view.apply(w.on_timer(&client, t));
        }
        longest = longest.max(t.elapsed());
    }
    // A handler waiting for the server would take its 2 s latency; a loaded host only adds
    // its wait for a CPU, which the 200 ms bar holds against on a quiet one.
    assert!(
        longest < Duration::from_millis(1500),
        "a handler blocked for {longest:?}"
    );
    if load_support::quiet_host(load.stop()) {
        assert!(
            longest < Duration::from_millis(200),
            "a handler blocked for {longest:?}"
        );
    }
    assert!(
        w.stats.connects >= 2,
        "the unanswered watch was abandoned and retried: {:?}",
        w.stats
    );
    api.set_latency(Duration::ZERO);
}

/// The API server named by a host name: the watch looks the name up on a thread of its own,
/// never on the thread that drives it, and tries every address in order. `localhost` answering
/// ::1 first (as on hosts whose /etc/hosts lists both) while the server listens on 127.0.0.1
/// only still gets its watch, through one connection.
#[test]
fn a_name_whose_first_address_refuses_still_gets_its_watch_resolved_off_the_loop() {
    let (api, dir, _) = setup();
    let kc = dir.path().join("kubeconfig-localhost");
    let text = std::fs::read_to_string(dir.path().join("kubeconfig")).unwrap();
    let ip_url = api.url();
    let name_url = ip_url.replace("127.0.0.1", "localhost");
    assert!(text.contains(&ip_url), "{text}");
    std::fs::write(&kc, text.replace(&ip_url, &name_url)).unwrap();
    let client = Client::from_env(&KubeOptions {
        kubeconfig: Some(kc.to_string_lossy().into_owned()),
        timeout: Duration::from_secs(5),
        qps: 0.0,
        ..KubeOptions::default()
    })
    .unwrap();

    let lookups: Arc<Mutex<Vec<(String, std::thread::ThreadId)>>> = Arc::default();
    let recorded = lookups.clone();
    let mut w = PodWatch::new(NODE, WatchConfig::default());
    w.set_resolver(Arc::new(move |host: &str, port: u16| {
        recorded
            .lock()
            .unwrap()
            .push((host.to_string(), std::thread::current().id()));
        Ok(vec![
            std::net::SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)),
            std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        ])
    }));
    let mut poll = Poll::new().unwrap();
    w.register(poll.registry(), WATCH).unwrap();
    let mut view = View::default();
    view.apply(w.relist(&client, Instant::now()).unwrap());
    api.create_pod(&pod("after-the-list", NODE)).unwrap();
    let done = || true;
    assert!(
        run_loop(
            &mut poll,
            &mut w,
            &client,
            &mut view,
            &api,
            &done,
            Duration::from_secs(20)
        ),
        "the watch never delivered the new pod (stats {:?})",
        w.stats
    );
    assert!(view.pods.contains_key("default/after-the-list"));
    assert_eq!(
        w.stats.connects, 1,
        "one connection, through the second address"
    );
    let lookups = lookups.lock().unwrap();
    assert!(!lookups.is_empty(), "the name was never looked up");
    let loop_thread = std::thread::current().id();
    for (host, thread) in lookups.iter() {
        assert_eq!(host, "localhost");
        assert_ne!(
            *thread, loop_thread,
            "the name was looked up on the loop's thread"
        );
    }
}
