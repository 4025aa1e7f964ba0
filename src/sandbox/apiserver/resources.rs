//! The table of API resources the fake serves: group, version, plural, kind, scope and verbs.
//! Pure data shared by routing, storage, discovery and tables; owns no state and does no I/O.

/// One served resource (a group/version/plural triple) and how discovery describes it.
#[derive(Debug)]
pub struct ResourceDef {
    /// API group; "" is the core group served under /api.
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub singular: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    pub short_names: &'static [&'static str],
    pub verbs: &'static [&'static str],
    /// Subresources served under `<plural>/<name>/<sub>`.
    pub subresources: &'static [&'static str],
    /// Objects are kept in the store (false for review-style create-only resources).
    pub stored: bool,
}

impl ResourceDef {
    /// "v1" for the core group, "group/version" otherwise.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// Key used by the store and by fault matching: "pods", "leases.coordination.k8s.io".
    pub fn key(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }
}

const OBJECT_VERBS: &[&str] = &[
    "create", "delete", "get", "list", "patch", "update", "watch",
];
const CREATE_ONLY: &[&str] = &["create"];

pub static RESOURCES: &[ResourceDef] = &[
    ResourceDef {
        group: "",
        version: "v1",
        plural: "pods",
        singular: "pod",
        kind: "Pod",
        namespaced: true,
        short_names: &["po"],
        verbs: OBJECT_VERBS,
        subresources: &["status"],
        stored: true,
    },
    ResourceDef {
        group: "",
        version: "v1",
        plural: "nodes",
        singular: "node",
        kind: "Node",
        namespaced: false,
        short_names: &["no"],
        verbs: OBJECT_VERBS,
        subresources: &["status"],
        stored: true,
    },
    ResourceDef {
        group: "",
        version: "v1",
        plural: "events",
        singular: "event",
        kind: "Event",
        namespaced: true,
        short_names: &["ev"],
        verbs: OBJECT_VERBS,
        subresources: &[],
        stored: true,
    },
    ResourceDef {
        group: "",
        version: "v1",
        plural: "namespaces",
        singular: "namespace",
        kind: "Namespace",
        namespaced: false,
        short_names: &["ns"],
        verbs: OBJECT_VERBS,
        subresources: &["status"],
        stored: true,
    },
    ResourceDef {
        group: "coordination.k8s.io",
        version: "v1",
        plural: "leases",
        singular: "lease",
        kind: "Lease",
        namespaced: true,
        short_names: &[],
        verbs: OBJECT_VERBS,
        subresources: &[],
        stored: true,
    },
    ResourceDef {
        group: "authentication.k8s.io",
        version: "v1",
        plural: "tokenreviews",
        singular: "tokenreview",
        kind: "TokenReview",
        namespaced: false,
        short_names: &[],
        verbs: CREATE_ONLY,
        subresources: &[],
        stored: false,
    },
    ResourceDef {
        group: "authorization.k8s.io",
        version: "v1",
        plural: "subjectaccessreviews",
        singular: "subjectaccessreview",
        kind: "SubjectAccessReview",
        namespaced: false,
        short_names: &[],
        verbs: CREATE_ONLY,
        subresources: &[],
        stored: false,
    },
    ResourceDef {
        group: "authorization.k8s.io",
        version: "v1",
        plural: "selfsubjectaccessreviews",
        singular: "selfsubjectaccessreview",
        kind: "SelfSubjectAccessReview",
        namespaced: false,
        short_names: &[],
        verbs: CREATE_ONLY,
        subresources: &[],
        stored: false,
    },
];

/// The resource served at `group/version/plural`, if any.
pub fn find(group: &str, version: &str, plural: &str) -> Option<&'static ResourceDef> {
    RESOURCES
        .iter()
        .find(|r| r.group == group && r.version == version && r.plural == plural)
}

/// Groups other than core, in discovery order, each with its single version.
pub fn groups() -> Vec<(&'static str, &'static str)> {
    let mut out: Vec<(&'static str, &'static str)> = Vec::new();
    for r in RESOURCES {
        if !r.group.is_empty() && !out.iter().any(|(g, _)| *g == r.group) {
            out.push((r.group, r.version));
        }
    }
    out
}

pub fn pods() -> &'static ResourceDef {
    &RESOURCES[0]
}
pub fn nodes() -> &'static ResourceDef {
    &RESOURCES[1]
}
pub fn namespaces() -> &'static ResourceDef {
    &RESOURCES[3]
}
