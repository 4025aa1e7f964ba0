//! Process tier, authentication floods: random bearer tokens from an anonymous client cost the
//! caller, not the node: pod lifecycle keeps its pace, reviews stay bounded, answers are cached,
//! and certificate callers and token callers of other addresses keep getting their reviews.
//!
//! `VK_FLOOD_SECS` sets the flood length (default 5). Waits poll; deadlines are failure bounds.

use crate::daemon_support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use daemon_support::{kubelet_status, running_with_vm, token_reviews, World};
use vk_cocoon::sandbox::apiserver::ReviewUser;
use vk_cocoon::sandbox::demo_pod;

/// Status of `GET /pods` from `interface` (a loopback address), with curl's extra `args`.
fn kubelet_status_as(w: &World, interface: &str, args: &[&str]) -> String {
    let out = std::process::Command::new("curl")
        .args([
            "-sk",
            "--max-time",
            "30",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .args(["--interface", interface])
        .args(args)
        .arg(format!("https://127.0.0.1:{}/pods", w.kubelet_port))
        .output()
        .expect("run curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Time from creating a pod to seeing it Running with its VM.
fn create_to_running(w: &World, name: &str) -> Duration {
    let start = Instant::now();
    w.api
        .create_pod(&demo_pod("default", name, "clone", "base"))
        .expect("create pod");
    w.wait(&format!("{name} Running"), Duration::from_secs(60), || {
        running_with_vm(w, name)
    });
    start.elapsed()
}

/// Sends batches of requests with fresh random tokens until `stop`, from 127.0.0.2 (another
/// address than the legitimate caller's); counts them, and their answers by code (401, 429,
/// other) in `codes`.
fn flood(
    port: u16,
    dir: std::path::PathBuf,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicUsize>,
    codes: Arc<[AtomicUsize; 3]>,
) {
    let mut batch = 0u64;
    let path = dir.join("flood.curlrc");
    while !stop.load(Ordering::SeqCst) {
        batch += 1;
        // Options do not carry over `next`: every request block names its own.
        let blocks: Vec<String> = (0..64)
            .map(|i| {
                let salt = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .subsec_nanos();
                format!(
                    "url = \"https://127.0.0.1:{port}/pods\"\ninsecure\nsilent\nmax-time = 30\ninterface = \"127.0.0.2\"\n\
                     output = \"/dev/null\"\nwrite-out = \"%{{http_code}}\\n\"\n\
                     header = \"Authorization: Bearer flood-{batch}-{i}-{salt}\"\n"
                )
            })
            .collect();
        if std::fs::write(&path, blocks.join("next\n")).is_err() {
            return;
        }
        let out = std::process::Command::new("curl")
            .args(["--parallel", "--parallel-max", "32", "-K"])
            .arg(&path)
            .output();
        if let Ok(o) = out {
            for code in String::from_utf8_lossy(&o.stdout).lines() {
                let slot = match code {
                    "401" => 0,
                    "429" => 1,
                    _ => 2,
                };
                codes[slot].fetch_add(1, Ordering::SeqCst);
            }
        }
        sent.fetch_add(64, Ordering::SeqCst);
    }
}

/// Two flooding threads (see `flood`): the stop flag, requests sent, answers by code and the
/// threads to join.
type Flood = (
    Arc<AtomicBool>,
    Arc<AtomicUsize>,
    Arc<[AtomicUsize; 3]>,
    Vec<std::thread::JoinHandle<()>>,
);

fn start_flood(w: &World) -> Flood {
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let codes: Arc<[AtomicUsize; 3]> = Arc::new(Default::default());
    let flooders = (0..2)
        .map(|n| {
            let (stop, sent, port) = (stop.clone(), sent.clone(), w.kubelet_port);
            let codes = codes.clone();
            let dir = w.path(&format!("flood-{n}"));
            let _ = std::fs::create_dir_all(&dir);
            std::thread::spawn(move || flood(port, dir, stop, sent, codes))
        })
        .collect();
    (stop, sent, codes, flooders)
}

/// The TokenReviews a flood of `length` may cost: a burst of 10, then 5 a second (two calls
/// each at most).
fn review_budget(length: Duration) -> usize {
    10 + 5 * (length.as_secs() as usize + 1)
}

#[test]
fn a_random_token_flood_leaves_lifecycle_alone_and_reviews_bounded() {
    let flood_secs: u64 = std::env::var("VK_FLOOD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let mut w = World::new();
    w.seed_snapshot("base");
    w.api.add_token_user(
        "ops-token",
        ReviewUser {
            username: "ops".into(),
            uid: "7".into(),
            groups: vec![],
        },
    );
    w.api
        .set_access_reviewer(|spec| (spec["user"] == "ops", "ops only".into()));
    w.start_daemon();

    let calm = create_to_running(&w, "calm");
    // A legitimate caller: one review, then answers from the cache.
    assert_eq!(kubelet_status(&w, "ops-token"), "200");
    let primed = token_reviews(&w);
    assert_eq!(kubelet_status(&w, "ops-token"), "200");
    assert_eq!(token_reviews(&w), primed, "the second call is a cache hit");

    let (stop, sent, codes, flooders) = start_flood(&w);
    let flood_start = Instant::now();
    // Let the flood spend the review budget before the lifecycle is measured.
    w.wait("flood under way", Duration::from_secs(60), || {
        (sent.load(Ordering::SeqCst) >= 128).then_some(())
    });
    let busy = create_to_running(&w, "busy");
    let mut legit = Vec::new();
    // The flood lasts `flood_secs`, and on a host too loaded to send it fast, until it is big
    // enough to show the review budget (twice the budget of its length).
    let flood_cap = Duration::from_secs(flood_secs.max(5) * 12);
    while flood_start.elapsed() < Duration::from_secs(flood_secs)
        || (sent.load(Ordering::SeqCst) <= 2 * review_budget(flood_start.elapsed())
            && flood_start.elapsed() < flood_cap)
    {
        let t = Instant::now();
        assert_eq!(
            kubelet_status(&w, "ops-token"),
            "200",
            "legitimate call under flood"
        );
        legit.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::SeqCst);
    for f in flooders {
        let _ = f.join();
    }
    let flooded = flood_start.elapsed();
    let reviews = token_reviews(&w) - primed;
    let sent = sent.load(Ordering::SeqCst);
    legit.sort();
    let [unauthorized, too_many, other] = [0, 1, 2].map(|i| codes[i].load(Ordering::SeqCst));
    eprintln!(
        "create→Running: {calm:?} calm, {busy:?} under flood; {sent} flood requests in \
         {flooded:?} ({unauthorized} × 401, {too_many} × 429, {other} other) made {reviews} \
         TokenReviews; legitimate /pods p50 {:?} max {:?}",
        legit.get(legit.len() / 2),
        legit.last()
    );
    assert_eq!(other, 0, "every flood request is answered 401 or 429");
    // The flood shares the host's CPU with the daemon and its cocoon children: judged against
    // the calm create on the same host (a loop stalled on reviews takes far longer).
    let pace = Duration::from_secs(5).max(calm * 5);
    assert!(
        busy < pace,
        "pod create → Running took {busy:?} under the flood ({calm:?} without; bound {pace:?})"
    );
    let bound = review_budget(flooded);
    assert!(
        reviews <= bound,
        "{reviews} TokenReviews for {sent} flood requests in {flooded:?} (bound {bound})"
    );
    assert!(
        sent > 2 * bound,
        "the flood was too small to show the bound: {sent}"
    );
}

/// While one address floods random tokens, callers the daemon has never seen still get their
/// reviews: certificate callers (a fresh user each, so each needs a SubjectAccessReview) from
/// the loopback address, and token callers (a fresh token each) from another address. Each is
/// answered 200, not 429, within curl's generous 30 s.
#[test]
fn a_token_flood_from_one_address_starves_neither_certificates_nor_other_addresses() {
    let mut w = World::new();
    let dir = w.path("certs");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let certs: Vec<(String, String)> = (0..6)
        .map(|i| {
            let (cert, key) = w
                .api
                .issue_client_cert(&format!("cert-user-{i}"))
                .expect("cert");
            let (c, k) = (dir.join(format!("{i}.crt")), dir.join(format!("{i}.key")));
            std::fs::write(&c, cert).expect("write cert");
            std::fs::write(&k, key).expect("write key");
            (c.display().to_string(), k.display().to_string())
        })
        .collect();
    for i in 0..3 {
        let user = ReviewUser {
            username: format!("token-user-{i}"),
            uid: i.to_string(),
            groups: vec![],
        };
        w.api.add_token_user(&format!("fresh-token-{i}"), user);
    }
    w.start_daemon();

    let (stop, sent, codes, flooders) = start_flood(&w);
    // The flood has spent whatever budget it can before the callers come.
    w.wait("flood under way", Duration::from_secs(30), || {
        (codes[1].load(Ordering::SeqCst) >= 64).then_some(())
    });
    let mut answers = Vec::new();
    for (i, (cert, key)) in certs.iter().enumerate() {
        let code = kubelet_status_as(&w, "127.0.0.1", &["--cert", cert, "--key", key]);
        answers.push(format!("cert-user-{i}: {code}"));
    }
    // Within another address's own burst (three), without waiting for a refill.
    for i in 0..3 {
        let header = format!("Authorization: Bearer fresh-token-{i}");
        let code = kubelet_status_as(&w, "127.0.0.3", &["-H", &header]);
        answers.push(format!("fresh-token-{i} from 127.0.0.3: {code}"));
    }
    stop.store(true, Ordering::SeqCst);
    for f in flooders {
        let _ = f.join();
    }
    let [unauthorized, too_many, _] = [0, 1, 2].map(|i| codes[i].load(Ordering::SeqCst));
    eprintln!(
        "{} flood requests ({unauthorized} × 401, {too_many} × 429); callers: {answers:?}",
        sent.load(Ordering::SeqCst)
    );
    assert!(
        answers.iter().all(|a| a.ends_with(": 200")),
        "starved under the flood: {answers:?}"
    );
}
