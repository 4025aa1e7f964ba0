//! The operator's VM names: which namespaces a name can belong to under the annotation
//! contract's three naming schemes, what a name proves, and the agent slot (role) it encodes.
//!
//! The schemes (a pod `<pod>` in namespace `<ns>`):
//! * plain (the oldest): `vk-<ns>-<pod>`;
//! * dotted: `vk-<ns>.<pod>`;
//! * hashed (the newest): `vk-<ns>-<pod, dots as dashes>-<h>`, `<h>` the first 6 hex digits of
//!   SHA-256 over `<ns>/<pod>`.
//!
//! A namespace is a DNS label (no dots), but a pod name may hold dashes and dots, so the plain
//! and dotted forms are ambiguous: `vk-team-b-app-0` is pod `b-app-0` of `team` or pod `app-0` of
//! `team-b`. Only a hashed name whose digest checks out proves its namespace; every other name
//! only narrows the candidates, and the daemon's ownership record must settle the rest. Pure
//! functions only.

use sha2::{Digest, Sha256};

/// The longest name cocoon accepts for a VM (snapshot names share the limit).
pub const NAME_MAX: usize = 63;

/// cocoon's VM name syntax: `^[a-zA-Z0-9][a-zA-Z0-9._-]{0,62}$`.
pub fn valid_vm_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    name.len() <= NAME_MAX
        && bytes.next().is_some_and(|b| b.is_ascii_alphanumeric())
        && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A Kubernetes namespace name: an RFC 1123 label.
pub fn valid_namespace(ns: &str) -> bool {
    let b = ns.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// The plain-scheme name of pod `pod` in `ns`.
pub fn plain_name(ns: &str, pod: &str) -> String {
    format!("vk-{ns}-{pod}")
}

/// The dotted-scheme name of pod `pod` in `ns`.
pub fn dotted_name(ns: &str, pod: &str) -> String {
    format!("vk-{ns}.{pod}")
}

/// The hashed-scheme name of pod `pod` in `ns`.
pub fn hashed_name(ns: &str, pod: &str) -> String {
    format!("vk-{ns}-{}-{}", pod.replace('.', "-"), name_hash(ns, pod))
}

/// First 3 bytes of SHA-256 over `<ns>/<pod>`, lower-case hex.
fn name_hash(ns: &str, pod: &str) -> String {
    let digest = Sha256::digest(format!("{ns}/{pod}").as_bytes());
    digest[..3].iter().map(|b| format!("{b:02x}")).collect()
}

/// What a VM name says about the namespace it was made for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NameOwner {
    /// A hashed name whose digest checks out for exactly this namespace.
    Proved(String),
    /// An operator name that may belong to any of these namespaces (never empty, sorted).
    Candidates(Vec<String>),
    /// Not an operator name (`vk-<ns>-…` / `vk-<ns>.…` of no valid namespace).
    Foreign,
}

impl NameOwner {
    /// The name may belong to `ns`.
    pub fn admits(&self, ns: &str) -> bool {
        match self {
            NameOwner::Proved(p) => p == ns,
            NameOwner::Candidates(c) => c.iter().any(|n| n == ns),
            NameOwner::Foreign => false,
        }
    }

    /// The name belongs to `ns` and to no other namespace: proof enough to read the state of
    /// a VM of this name that carries no ownership record.
    pub fn proves(&self, ns: &str) -> bool {
        match self {
            NameOwner::Proved(p) => p == ns,
            NameOwner::Candidates(c) => c.len() == 1 && c[0] == ns,
            NameOwner::Foreign => false,
        }
    }
}

/// Which namespaces `vm_name` can belong to. `pods` are pod names worth checking the hashed
/// scheme against (the pod's own name, a fork source's pod): a hashed name of a pod with dots
/// in its name is recognised only through them, the rest are recognised from the name alone.
pub fn owner(vm_name: &str, pods: &[&str]) -> NameOwner {
    let Some(rest) = vm_name.strip_prefix("vk-") else {
        return NameOwner::Foreign;
    };
    if let Some(ns) = hashed_namespace(rest, pods) {
        return NameOwner::Proved(ns);
    }
    let mut candidates: Vec<String> = Vec::new();
    // Plain: `<ns>-<pod>` at every dash. Dotted: `<ns>.<pod>` at the first dot.
    let dashes = rest.match_indices('-').map(|(i, _)| i);
    let dot = rest.find('.');
    for cut in dashes.chain(dot) {
        let (ns, pod) = (&rest[..cut], &rest[cut + 1..]);
        if !pod.is_empty() && valid_namespace(ns) && !candidates.iter().any(|c| c == ns) {
            candidates.push(ns.to_string());
        }
    }
    if candidates.is_empty() {
        return NameOwner::Foreign;
    }
    candidates.sort();
    NameOwner::Candidates(candidates)
}

/// The namespace a hashed name proves: `rest` = `<ns>-<body>-<6 hex>` where the digest of
/// `<ns>/<pod>` matches for `pod` = `body` or one of `pods` that renders as `body`.
fn hashed_namespace(rest: &str, pods: &[&str]) -> Option<String> {
    let (head, hash) = rest.rsplit_once('-')?;
    if hash.len() != 6 || !hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    for (cut, _) in head.match_indices('-') {
        let (ns, body) = (&head[..cut], &head[cut + 1..]);
        if body.is_empty() || !valid_namespace(ns) {
            continue;
        }
        let hinted = pods.iter().copied().filter(|p| p.replace('.', "-") == body);
        if std::iter::once(body)
            .chain(hinted)
            .any(|pod| name_hash(ns, pod) == hash)
        {
            return Some(ns.to_string());
        }
    }
    None
}

/// The agent slot a VM name encodes for CocoonSet `cocoonset` in `ns`, under whichever scheme
/// made it; None when it is not an agent's name (a toolbox, or no CocoonSet owner).
pub fn agent_slot(ns: &str, cocoonset: &str, vm_name: &str) -> Option<u64> {
    if cocoonset.is_empty() {
        return None;
    }
    let plain = vm_name.strip_prefix(&format!("vk-{ns}-{cocoonset}-"));
    let dotted = vm_name.strip_prefix(&format!("vk-{ns}.{cocoonset}-"));
    if let Some(slot) = plain.or(dotted).and_then(go_atoi) {
        return Some(slot);
    }
    let rest = vm_name.strip_prefix(&format!("vk-{ns}-{}-", cocoonset.replace('.', "-")))?;
    let slot: u64 = rest.split('-').next()?.parse().ok()?;
    (hashed_name(ns, &format!("{cocoonset}-{slot}")) == vm_name).then_some(slot)
}

/// Go's `strconv.Atoi` on a slot with no dash: an optional `+`, decimal digits, leading zeros
/// allowed (the plain scheme's slot parse).
fn go_atoi(s: &str) -> Option<u64> {
    let digits = s.strip_prefix('+').unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The snapshot-policy role of a pod: `main` (slot 0), `sub-agent` (slot > 0) or `toolbox`.
pub fn role(ns: &str, cocoonset: &str, vm_name: &str) -> &'static str {
    match agent_slot(ns, cocoonset, vm_name) {
        Some(0) => "main",
        Some(_) => "sub-agent",
        None => "toolbox",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_contracts_hashed_test_vectors() {
        assert_eq!(hashed_name("prod", "demo-2"), "vk-prod-demo-2-496021");
        assert_eq!(hashed_name("prod", "toolbox"), "vk-prod-toolbox-869218");
        assert_eq!(hashed_name("prod", "demo.v1-0"), "vk-prod-demo-v1-0-ac2538");
        assert_eq!(hashed_name("prod", "demo-v1-0"), "vk-prod-demo-v1-0-17548c");
        assert_eq!(
            hashed_name("prod", "demo-shell"),
            "vk-prod-demo-shell-c79ab8"
        );
        assert_eq!(
            format!("{}-hibernate-import", hashed_name("prod", "demo-0")),
            "vk-prod-demo-0-71ea62-hibernate-import"
        );
        assert_eq!(agent_slot("prod", "demo", "vk-prod-demo-2-496021"), Some(2));
        assert_eq!(
            agent_slot("prod", "demo.v1", "vk-prod-demo-v1-0-ac2538"),
            Some(0)
        );
        assert_eq!(
            agent_slot("prod", "demo-v1", "vk-prod-demo-v1-0-17548c"),
            Some(0)
        );
        // The digest decides: demo.v1's name is not demo-v1's and vice versa.
        assert_eq!(
            agent_slot("prod", "demo-v1", "vk-prod-demo-v1-0-ac2538"),
            None
        );
        assert_eq!(agent_slot("prod", "demo", "vk-prod-demo-0-000000"), None);
        assert_eq!(
            agent_slot("prod", "demo", "vk-prod-demo-shell-c79ab8"),
            None
        );
    }

    #[test]
    fn roles_under_every_scheme() {
        for (name, role_want) in [
            ("vk-prod-demo-0", "main"),
            ("vk-prod-demo-00", "main"),
            ("vk-prod-demo-3", "sub-agent"),
            ("vk-prod-demo-+1", "sub-agent"),
            ("vk-prod-demo-db-2", "toolbox"),
            ("vk-prod-other-0", "toolbox"),
            ("prod-demo-0", "toolbox"),
            ("vk-prod.demo-0", "main"),
            ("vk-prod.demo-4", "sub-agent"),
            ("vk-prod.demo-x-4", "toolbox"),
            ("vk-prod-demo-0-71ea62", "main"),
            ("vk-prod-demo-2-496021", "sub-agent"),
            ("vk-prod-demo-0-000000", "toolbox"),
        ] {
            assert_eq!(role("prod", "demo", name), role_want, "{name}");
        }
        assert_eq!(role("prod", "", "vk-prod-demo-0"), "toolbox");
    }

    #[test]
    fn a_hashed_name_proves_its_namespace() {
        let team_b = hashed_name("team-b", "app-0");
        assert_eq!(owner(&team_b, &[]), NameOwner::Proved("team-b".into()));
        assert!(owner(&team_b, &[]).proves("team-b"));
        assert!(!owner(&team_b, &[]).admits("team"));
        // A dotted pod name is recognised through the pod's name.
        let dotted_pod = hashed_name("prod", "demo.v1-0");
        assert!(!owner(&dotted_pod, &[]).proves("prod"));
        assert!(owner(&dotted_pod, &["demo.v1-0"]).proves("prod"));
        // A hint cannot prove another namespace: the digest is over the namespace too.
        assert!(!owner(&dotted_pod, &["demo.v1-0"]).admits("prod-demo"));
    }

    #[test]
    fn plain_and_dotted_names_only_narrow_the_candidates() {
        let o = owner("vk-team-b-app-0", &[]);
        assert_eq!(
            o,
            NameOwner::Candidates(vec!["team".into(), "team-b".into(), "team-b-app".into()])
        );
        assert!(o.admits("team") && o.admits("team-b"));
        assert!(!o.proves("team") && !o.proves("team-b"));
        assert!(!o.admits("evil") && !o.admits("teamb"));
        // One reading only: proof by name.
        assert!(owner("vk-prod-web", &[]).proves("prod"));
        assert!(owner("vk-prod.web", &[]).proves("prod"));
        // A dotted pod name under the plain scheme reads as the dotted scheme of another.
        let o = owner("vk-team-web.1", &[]);
        assert!(o.admits("team") && o.admits("team-web") && !o.proves("team"));
    }

    #[test]
    fn names_of_no_namespace_are_foreign() {
        for name in [
            "demo",
            "vk-",
            "vk--x",
            "vk-Team-x",
            "vk-x",
            "VK-team-x",
            "fork-vk-a-b",
        ] {
            assert_eq!(owner(name, &[]), NameOwner::Foreign, "{name}");
            assert!(!owner(name, &[]).admits("team"), "{name}");
        }
    }

    #[test]
    fn vm_name_and_namespace_syntax() {
        assert!(valid_vm_name("vk-prod-demo-0"));
        assert!(valid_vm_name(&"a".repeat(63)));
        for bad in ["", "-a", ".a", "a b", "a/b", "a:b", "é", "--all"] {
            assert!(!valid_vm_name(bad), "{bad:?}");
        }
        assert!(!valid_vm_name(&"a".repeat(64)));
        assert!(valid_namespace("team-b") && valid_namespace("a"));
        for bad in ["", "-a", "a-", "A", "a.b", "a_b"] {
            assert!(!valid_namespace(bad), "{bad:?}");
        }
    }
}
