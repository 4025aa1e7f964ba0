//! The source gate of a fresh bring-up: an http(s) image URL is judged (and its host name
//! resolved by the daemon) before anything fetches it; a clone-from-dir must lie below the
//! configured root (and the daemon walks it); a refusal fails the pod for good.

use super::*;

const SETTING: &str = "VK_IMAGE_URL_ALLOW_HOSTS";

/// A run-mode pod booting `url`, driven past the hibernate evidence and the fork removal.
fn run_url(h: &mut H, name: &str, url: &str) -> Vec<Effect> {
    let mut ann = managed(name, &format!("vk-ns-{name}"));
    ann.retain(|(k, _)| *k != ANN_IMAGE);
    ann.push((ANN_MODE, "run".into()));
    ann.push((ANN_IMAGE, url.into()));
    let e = h.feed(Input::PodUpserted(Box::new(mk(name, "u1", &ann))));
    let e = no_evidence(h, &e);
    let (op, cmd) = one_cocoon(&e);
    assert!(
        argv(&cmd).starts_with("snapshot rm fork-"),
        "{}",
        argv(&cmd)
    );
    h.cocoon(op, Answer::ok(""))
}

fn check_of(e: &[Effect]) -> (OpId, SourceCheck) {
    e.iter()
        .find_map(|x| match x {
            Effect::CheckSource { op, check } => Some((*op, check.clone())),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no source check in {e:?}"))
}

fn assert_refused(e: &[Effect], what: &str) {
    assert!(cocoon_ops(e).is_empty(), "nothing runs: {e:?}");
    assert!(
        events(e)
            .iter()
            .any(|(r, m)| *r == "ImageURLRefused" && m.contains(what) && m.contains(SETTING)),
        "{:?}",
        events(e)
    );
    assert!(
        statuses(e)
            .iter()
            .any(|(_, s)| s.phase.as_deref() == Some("Failed")),
        "phase Failed whatever the restart policy"
    );
    assert!(has_metric(
        e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "failed",
            reason: "image_url_refused",
        }
    ));
}

#[test]
fn an_address_literal_of_a_forbidden_class_is_refused_without_a_lookup() {
    for (url, what) in [
        (
            "http://169.254.169.254/latest/meta-data/",
            "the cloud metadata address",
        ),
        ("http://[fe80::1]/img.qcow2", "a link-local address"),
        ("https://127.0.0.1:8443/img.qcow2", "a loopback address"),
        (
            "http://metadata.google.internal/x",
            "a cloud metadata service",
        ),
    ] {
        let mut h = H::new(ProviderConfig::default());
        let e = run_url(&mut h, "a", url);
        assert!(
            !e.iter().any(|x| matches!(x, Effect::CheckSource { .. })),
            "{url}: judged without the host"
        );
        assert_refused(&e, what);
        // The refusal stands: time passing retries nothing.
        let later = h.advance(Duration::from_secs(600));
        assert!(cocoon_ops(&later).is_empty(), "{later:?}");
    }
}

#[test]
fn a_host_name_is_resolved_by_the_daemon_before_the_pull() {
    let url = "https://images.example/noble.qcow2";
    let mut h = H::new(ProviderConfig::default());
    let e = run_url(&mut h, "a", url);
    assert!(cocoon_ops(&e).is_empty(), "no pull before the verdict");
    let (op, check) = check_of(&e);
    assert_eq!(
        check,
        SourceCheck::ImageHost {
            url: url.into(),
            host: "images.example".into()
        }
    );
    let e = h.feed(Input::SourceChecked {
        op,
        verdict: SourceVerdict::Allowed,
    });
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), format!("image pull {url}"));

    let mut h = H::new(ProviderConfig::default());
    let (op, _) = check_of(&run_url(&mut h, "b", url));
    let msg = format!(
        "image URL {url:?} refused: its host images.example resolves to 10.0.0.9, a private \
         address; name the host in {SETTING} to allow it"
    );
    let e = h.feed(Input::SourceChecked {
        op,
        verdict: SourceVerdict::Refused(msg),
    });
    assert_refused(&e, "resolves to 10.0.0.9");
}

#[test]
fn a_lookup_that_could_not_answer_is_retried_and_an_allowed_host_is_pulled_at_once() {
    let url = "https://images.example/noble.qcow2";
    let mut h = H::new(ProviderConfig::default());
    let (op, _) = check_of(&run_url(&mut h, "a", url));
    let e = h.feed(Input::SourceChecked {
        op,
        verdict: SourceVerdict::Unavailable("resolve images.example: timed out".into()),
    });
    assert!(events(&e).iter().any(|(r, _)| *r == "CreateBringUpFailed"));
    assert!(!events(&e).iter().any(|(r, _)| *r == "ImageURLRefused"));
    let later = h.advance(Duration::from_secs(60));
    assert!(
        cocoon_ops(&later)
            .iter()
            .any(|(_, c)| argv(c) == "vm inspect vk-ns-a"),
        "the create is retried: {later:?}"
    );

    let cfg = ProviderConfig {
        image_url_allow_hosts: vec!["169.254.169.254".into()],
        ..Default::default()
    };
    let mut h = H::new(cfg);
    let e = run_url(&mut h, "c", "http://169.254.169.254/img.qcow2");
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "image pull http://169.254.169.254/img.qcow2");
}

/// A clone-from-dir pod, driven past the hibernate evidence and the fork removal.
fn clone_dir(h: &mut H, name: &str, dir: &str) -> Vec<Effect> {
    let mut ann = managed(name, &format!("vk-ns-{name}"));
    ann.push((ANN_CLONE_FROM_DIR, dir.into()));
    let e = h.feed(Input::PodUpserted(Box::new(mk(name, "u1", &ann))));
    let e = no_evidence(h, &e);
    let (op, _) = one_cocoon(&e);
    h.cocoon(op, Answer::ok(""))
}

fn dir_refused(e: &[Effect], what: &str) {
    assert!(cocoon_ops(e).is_empty(), "nothing runs: {e:?}");
    assert!(
        events(e).iter().any(|(r, m)| *r == "CloneFromDirRefused"
            && m.contains(what)
            && m.contains("VK_CLONE_FROM_DIR_ROOT")),
        "{:?}",
        events(e)
    );
    assert!(statuses(e)
        .iter()
        .any(|(_, s)| s.phase.as_deref() == Some("Failed")));
    assert!(has_metric(
        e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "failed",
            reason: "clone_dir_refused",
        }
    ));
}

#[test]
fn clone_from_dir_is_refused_without_a_root_and_outside_it() {
    let mut h = H::new(ProviderConfig::default());
    let e = clone_dir(&mut h, "a", "/srv/snaps/vm-a");
    dir_refused(&e, "which is not set");

    let cfg = ProviderConfig {
        clone_from_dir_root: Some("/srv/snaps".into()),
        ..Default::default()
    };
    for dir in [
        "/srv/snaps-evil/vm-a",
        "/var/lib/cocoon/run/cloudhypervisor/X",
    ] {
        let mut h = H::new(cfg.clone());
        let e = clone_dir(&mut h, "a", dir);
        assert!(!e.iter().any(|x| matches!(x, Effect::CheckSource { .. })));
        dir_refused(&e, "not below VK_CLONE_FROM_DIR_ROOT (/srv/snaps)");
    }

    // Below the root: the daemon walks it; a symlink on the way is its refusal.
    let mut h = H::new(cfg);
    let e = clone_dir(&mut h, "a", "/srv/snaps/team/vm-a");
    let (op, check) = check_of(&e);
    assert_eq!(
        check,
        SourceCheck::CloneDir {
            dir: "/srv/snaps/team/vm-a".into(),
            root: "/srv/snaps".into()
        }
    );
    let msg = "clone-from-dir /srv/snaps/team/vm-a refused: /srv/snaps/team is a symlink (none \
               may be below VK_CLONE_FROM_DIR_ROOT)";
    let e = h.feed(Input::SourceChecked {
        op,
        verdict: SourceVerdict::Refused(msg.into()),
    });
    dir_refused(&e, "is a symlink");
}
