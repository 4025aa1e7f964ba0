//! Request routing and the API verbs: get, list, create, update, patch, delete (with pod
//! graceful deletion), the status subresources, reviews and discovery. Uses the store; no sockets.
//!
//! Here: routing and the dispatch of a resource request. list: lists and their continue
//! tokens; create: create with defaulting and validation; update: update and patch rules;
//! delete: (graceful) deletion; reviews: token and access reviews.

use super::discovery;
use super::http::{Request, Response};
use super::meta::ApiError;
use super::patch::PatchType;
use super::resources::{self, ResourceDef};
use super::select::Selector;
use super::store;
use super::table;
use super::Shared;
use serde_json::Value;

mod create;
mod delete;
mod list;
mod reviews;
mod update;

pub use create::create_object;
pub use delete::{delete_object, DeleteOptions};
pub use update::{patch_object, update_object};

use list::list_doc;
use reviews::{access_review, self_access_review, token_review};

/// Where a request path points.
#[derive(Debug, Clone)]
pub enum Target {
    Root,
    Version,
    Health,
    CoreVersions,
    GroupList,
    Group(String),
    ResourceList(String, String),
    OpenApiV3Index,
    OpenApiV3(String),
    Resource(ResourcePath),
}

#[derive(Debug, Clone)]
pub struct ResourcePath {
    pub def: &'static ResourceDef,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub sub: Option<String>,
    /// Reached through the legacy `/watch/` path prefix.
    pub legacy_watch: bool,
}

/// What the connection should do with a request.
pub enum Reply {
    Response(Response),
    Watch(super::watch::WatchSpec),
}

fn not_found_path() -> ApiError {
    ApiError::new(
        404,
        "NotFound",
        "the server could not find the requested resource",
    )
}

pub fn parse_target(path: &str) -> Result<Target, ApiError> {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    match segs.as_slice() {
        [] => Ok(Target::Root),
        ["version"] => Ok(Target::Version),
        ["healthz" | "livez" | "readyz", ..] => Ok(Target::Health),
        ["api"] => Ok(Target::CoreVersions),
        ["openapi", "v3"] => Ok(Target::OpenApiV3Index),
        ["openapi", "v3", rest @ ..] => Ok(Target::OpenApiV3(rest.join("/"))),
        ["api", "v1"] => Ok(Target::ResourceList(String::new(), "v1".into())),
        ["apis"] => Ok(Target::GroupList),
        ["apis", g] => Ok(Target::Group((*g).into())),
        ["apis", g, v] => Ok(Target::ResourceList((*g).into(), (*v).into())),
        ["api", "v1", rest @ ..] => resource_path("", "v1", rest).map(Target::Resource),
        ["apis", g, v, rest @ ..] => resource_path(g, v, rest).map(Target::Resource),
        _ => Err(not_found_path()),
    }
}

fn resource_path(group: &str, version: &str, rest: &[&str]) -> Result<ResourcePath, ApiError> {
    let (legacy_watch, rest) = match rest {
        ["watch", tail @ ..] => (true, tail),
        _ => (false, rest),
    };
    let (def, namespace, tail) = match rest {
        ["namespaces", ns, plural, tail @ ..] => match resources::find(group, version, plural) {
            Some(def) if def.namespaced => (def, Some((*ns).to_string()), tail),
            _ if group.is_empty() => {
                // /api/v1/namespaces/<name>/<sub>: the Namespace object itself.
                let def = resources::namespaces();
                (def, None, &rest[1..])
            }
            _ => return Err(not_found_path()),
        },
        [plural, tail @ ..] => {
            let def = resources::find(group, version, plural).ok_or_else(not_found_path)?;
            if def.namespaced && !tail.is_empty() {
                return Err(not_found_path());
            }
            (def, None, tail)
        }
        [] => return Err(not_found_path()),
    };
    let (name, sub) = match tail {
        [] => (None, None),
        [name] => (Some((*name).to_string()), None),
        [name, sub] if def.subresources.contains(sub) => {
            (Some((*name).to_string()), Some((*sub).to_string()))
        }
        _ => return Err(not_found_path()),
    };
    Ok(ResourcePath {
        def,
        namespace,
        name,
        sub,
        legacy_watch,
    })
}

impl ResourcePath {
    /// The API verb for this method ("get", "list", "watch", "create", ...).
    pub fn verb(&self, req: &Request) -> &'static str {
        match (req.method.as_str(), self.name.is_some()) {
            ("GET", true) if self.legacy_watch || req.query_flag("watch") => "watch",
            ("GET", true) => "get",
            ("GET", false) if self.legacy_watch || req.query_flag("watch") => "watch",
            ("GET", false) => "list",
            ("POST", _) => "create",
            ("PUT", _) => "update",
            ("PATCH", _) => "patch",
            ("DELETE", true) => "delete",
            ("DELETE", false) => "deletecollection",
            _ => "unknown",
        }
    }

    /// "pods" or "pods/status", as faults match and RBAC names it.
    pub fn resource_name(&self) -> String {
        match &self.sub {
            Some(sub) => format!("{}/{}", self.def.plural, sub),
            None => self.def.plural.to_string(),
        }
    }

    fn ns(&self) -> &str {
        self.namespace.as_deref().unwrap_or("")
    }
}

fn ok(status: u16, v: &Value) -> Result<Reply, ApiError> {
    Ok(Reply::Response(Response::json(status, v)))
}

fn parse_body(req: &Request) -> Result<Value, ApiError> {
    // Protobuf, YAML and CBOR bodies are valid to a real API server; this one speaks JSON only,
    // so it answers as the real one does for a media type it does not serve.
    let ct = req.header("content-type").unwrap_or("");
    let mime = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if !mime.is_empty() && mime != "application/json" && !mime.ends_with("+json") {
        return Err(ApiError::new(
            415,
            "UnsupportedMediaType",
            format!("the body of the request was in an unknown format - accepted media types include: application/json (got {ct:?})"),
        ));
    }
    let v: Value = serde_json::from_slice(&req.body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    if !v.is_object() && !v.is_array() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    Ok(v)
}

/// Serves a non-discovery request on a resource.
pub fn handle_resource(
    shared: &Shared,
    req: &Request,
    rp: &ResourcePath,
    verb: &str,
) -> Result<Reply, ApiError> {
    let allowed = rp.def.verbs.contains(&verb) || (verb == "deletecollection" && rp.def.stored);
    if !allowed {
        return Err(ApiError::method_not_allowed());
    }
    if rp.def.namespaced && rp.namespace.is_none() && !matches!(verb, "list" | "watch") {
        return Err(not_found_path());
    }
    match verb {
        "get" => {
            let name = rp.name.as_deref().unwrap_or("");
            let obj = shared
                .store
                .get(rp.def, rp.ns(), name)
                .ok_or_else(|| ApiError::not_found(rp.def.group, rp.def.plural, name))?;
            if table::wants_table(req.header("accept")) {
                let rv = store::obj_rv(&obj).parse().unwrap_or(0);
                let include = req.query("includeObject").unwrap_or("");
                return ok(200, &table::table(rp.def, &[obj], rv, include));
            }
            ok(200, &obj)
        }
        "list" => list::list(shared, req, rp),
        "watch" => Ok(Reply::Watch(super::watch::WatchSpec::from_request(
            shared, req, rp,
        )?)),
        "create" => {
            if rp.name.is_some() {
                return Err(ApiError::method_not_allowed());
            }
            let body = parse_body(req)?;
            match rp.def.plural {
                "tokenreviews" => ok(201, &token_review(shared, body)),
                "subjectaccessreviews" => ok(201, &access_review(shared, body)),
                "selfsubjectaccessreviews" => ok(201, &self_access_review(shared, body)),
                _ => ok(201, &create_object(shared, rp.def, rp.ns(), body)?),
            }
        }
        "update" => {
            let body = parse_body(req)?;
            let name = rp.name.as_deref().unwrap_or("");
            let out = update_object(shared, rp.def, rp.ns(), name, rp.sub.as_deref(), body)?;
            ok(200, &out)
        }
        "patch" => {
            let ct = req.header("content-type").unwrap_or("");
            let kind = PatchType::from_content_type(ct).ok_or_else(|| {
                ApiError::new(
                    415,
                    "UnsupportedMediaType",
                    format!("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json (got {ct:?})"),
                )
            })?;
            let body = parse_body(req)?;
            let name = rp.name.as_deref().unwrap_or("");
            let out = patch_object(
                shared,
                rp.def,
                rp.ns(),
                name,
                rp.sub.as_deref(),
                kind,
                &body,
            )?;
            ok(200, &out)
        }
        "delete" => {
            let opts = DeleteOptions::from_request(req)?;
            let name = rp.name.as_deref().unwrap_or("");
            let out = delete_object(shared, rp.def, rp.ns(), name, &opts)?;
            ok(200, &out)
        }
        "deletecollection" => {
            let opts = DeleteOptions::from_request(req)?;
            let selector = Selector::parse(req.query("fieldSelector"), req.query("labelSelector"))?;
            let (items, _) = shared.store.list(rp.def, rp.namespace.as_deref());
            let mut deleted = Vec::new();
            for item in items.iter().filter(|o| selector.matches(o)) {
                let (ns, name) = (store::obj_namespace(item), store::obj_name(item));
                match delete_object(shared, rp.def, ns, name, &opts) {
                    Ok(v) => deleted.push(v),
                    Err(e) if e.code == 404 => {}
                    Err(e) => return Err(e),
                }
            }
            ok(
                200,
                &list_doc(rp.def, deleted.iter(), shared.store.current_rv(), None),
            )
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

/// Serves discovery and health targets.
pub fn handle_meta(shared: &Shared, target: &Target) -> Result<Reply, ApiError> {
    match target {
        Target::Root => ok(200, &discovery::root_paths()),
        Target::Version => ok(200, &discovery::version()),
        Target::Health => Ok(Reply::Response(Response::text(200, "ok"))),
        Target::CoreVersions => ok(200, &discovery::core_versions(&shared.addr_string())),
        Target::GroupList => ok(200, &discovery::group_list()),
        Target::Group(g) => ok(200, &discovery::group(g).ok_or_else(not_found_path)?),
        Target::ResourceList(g, v) => ok(
            200,
            &discovery::resource_list(g, v).ok_or_else(not_found_path)?,
        ),
        Target::OpenApiV3Index => ok(200, &discovery::openapi_v3_index()),
        Target::OpenApiV3(path) => ok(
            200,
            &discovery::openapi_v3_group_version(path).ok_or_else(not_found_path)?,
        ),
        Target::Resource(_) => Err(not_found_path()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let t = |p: &str| match parse_target(p) {
            Ok(Target::Resource(rp)) => Some((
                rp.def.plural,
                rp.namespace.clone(),
                rp.name.clone(),
                rp.sub.clone(),
            )),
            _ => None,
        };
        assert_eq!(
            t("/api/v1/namespaces/default/pods/p1/status"),
            Some((
                "pods",
                Some("default".into()),
                Some("p1".into()),
                Some("status".into())
            ))
        );
        assert_eq!(t("/api/v1/pods"), Some(("pods", None, None, None)));
        assert_eq!(
            t("/api/v1/namespaces/kube-system"),
            Some(("namespaces", None, Some("kube-system".into()), None))
        );
        assert_eq!(
            t("/api/v1/namespaces"),
            Some(("namespaces", None, None, None))
        );
        assert_eq!(
            t("/api/v1/nodes/n1/status"),
            Some(("nodes", None, Some("n1".into()), Some("status".into())))
        );
        assert_eq!(
            t("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/n1"),
            Some((
                "leases",
                Some("kube-node-lease".into()),
                Some("n1".into()),
                None
            ))
        );
        assert_eq!(t("/api/v1/pods/x"), None);
        assert_eq!(t("/api/v1/nodes/n1/proxy"), None);
        assert_eq!(t("/apis/apps/v1/namespaces/x/deployments"), None);
        assert!(parse_target("/apis/coordination.k8s.io").is_ok());
    }
}
