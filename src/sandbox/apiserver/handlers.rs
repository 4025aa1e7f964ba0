//! Request routing and the API verbs: get, list, create, update, patch, delete (with pod
//! graceful deletion), the status subresources, reviews and discovery. Uses the store; no sockets.

use super::discovery;
use super::http::{Request, Response};
use super::meta::{self, ApiError};
use super::patch::{self, PatchType};
use super::resources::{self, ResourceDef};
use super::select::Selector;
use super::store::{self, metadata_mut, Mutation};
use super::table;
use super::Shared;
use base64::Engine;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

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
        "list" => list(shared, req, rp),
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

fn list_doc<'a>(
    def: &ResourceDef,
    items: impl Iterator<Item = &'a Value>,
    rv: u64,
    cont: Option<(String, usize)>,
) -> Value {
    // Like the real server, items in a list carry no kind/apiVersion.
    let items: Vec<Value> = items
        .map(|o| {
            let mut o = o.clone();
            if let Value::Object(m) = &mut o {
                m.remove("kind");
                m.remove("apiVersion");
            }
            o
        })
        .collect();
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if let Some((token, remaining)) = cont {
        metadata["continue"] = json!(token);
        metadata["remainingItemCount"] = json!(remaining);
    }
    json!({
        "kind": def.list_kind(),
        "apiVersion": def.api_version(),
        "metadata": metadata,
        "items": items,
    })
}

/// A continue token: the list's resourceVersion and the last key served.
fn encode_continue(rv: u64, ns: &str, name: &str) -> String {
    let raw = json!({"rv": rv, "ns": ns, "name": name}).to_string();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
}

fn decode_continue(token: &str) -> Result<(u64, String, String), ApiError> {
    let bad = || ApiError::bad_request("invalid continue token");
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| bad())?;
    let v: Value = serde_json::from_slice(&raw).map_err(|_| bad())?;
    let rv = v.get("rv").and_then(Value::as_u64).ok_or_else(bad)?;
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    Ok((rv, s("ns"), s("name")))
}

fn list(shared: &Shared, req: &Request, rp: &ResourcePath) -> Result<Reply, ApiError> {
    let selector = Selector::parse(req.query("fieldSelector"), req.query("labelSelector"))?;
    if let Some(rv) = req.query("resourceVersion").filter(|v| !v.is_empty()) {
        rv.parse::<u64>()
            .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {rv:?}")))?;
    }
    let (items, current_rv) = shared.store.list(rp.def, rp.namespace.as_deref());
    let mut matching: Vec<Arc<Value>> = items.into_iter().filter(|o| selector.matches(o)).collect();
    let mut list_rv = current_rv;
    if let Some(token) = req.query("continue").filter(|t| !t.is_empty()) {
        let (rv, ns, name) = decode_continue(token)?;
        if rv < shared.store.compacted_rv() {
            return Err(ApiError::expired(
                "The provided continue parameter is too old to display a consistent list result. \
                 You can start a new list without the continue parameter.",
            ));
        }
        list_rv = rv;
        let after = (ns, name);
        matching.retain(|o| {
            (
                store::obj_namespace(o).to_string(),
                store::obj_name(o).to_string(),
            ) > after
        });
    }
    let limit = req
        .query("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    let mut cont = None;
    if let Some(limit) = limit {
        if matching.len() > limit {
            let remaining = matching.len() - limit;
            matching.truncate(limit);
            if let Some(last) = matching.last() {
                cont = Some((
                    encode_continue(list_rv, store::obj_namespace(last), store::obj_name(last)),
                    remaining,
                ));
            }
        }
    }
    if table::wants_table(req.header("accept")) {
        let include = req.query("includeObject").unwrap_or("");
        let mut t = table::table(rp.def, &matching, list_rv, include);
        if let Some((token, remaining)) = cont {
            t["metadata"]["continue"] = json!(token);
            t["metadata"]["remainingItemCount"] = json!(remaining);
        }
        return ok(200, &t);
    }
    ok(
        200,
        &list_doc(rp.def, matching.iter().map(|a| a.as_ref()), list_rv, cont),
    )
}

fn check_kind(def: &ResourceDef, body: &mut Value) -> Result<(), ApiError> {
    let want_av = def.api_version();
    let kind = body.get("kind").and_then(Value::as_str).unwrap_or("");
    let av = body.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    if (!kind.is_empty() && kind != def.kind) || (!av.is_empty() && av != want_av) {
        return Err(ApiError::bad_request(format!(
            "the object provided is unrecognized (must be of type {}): {kind} {av}",
            def.kind
        )));
    }
    body["kind"] = json!(def.kind);
    body["apiVersion"] = json!(want_av);
    Ok(())
}

/// Creates an object with the API server's defaulting and validation for its kind.
pub fn create_object(
    shared: &Shared,
    def: &'static ResourceDef,
    namespace: &str,
    mut body: Value,
) -> Result<Value, ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    check_kind(def, &mut body)?;
    let body_ns = store::obj_namespace(&body).to_string();
    if def.namespaced && !body_ns.is_empty() && body_ns != namespace {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let md = metadata_mut(&mut body);
    md.remove("resourceVersion");
    if def.namespaced {
        md.insert("namespace".into(), json!(namespace));
    }
    match def.plural {
        "pods" => {
            let spec = body.get("spec").cloned().unwrap_or(json!({}));
            let mut spec = spec;
            for (k, v) in [
                ("restartPolicy", json!("Always")),
                ("terminationGracePeriodSeconds", json!(30)),
                ("dnsPolicy", json!("ClusterFirst")),
                ("schedulerName", json!("default-scheduler")),
            ] {
                if spec.get(k).is_none() {
                    spec[k] = v;
                }
            }
            body["spec"] = spec;
            // The pod create strategy discards any client-sent status.
            body["status"] = json!({"phase": "Pending", "qosClass": "BestEffort"});
        }
        "namespaces" => {
            body["status"] = json!({"phase": "Active"});
        }
        _ => {}
    }
    normalize_times(def, &mut body)?;
    validate(def, &body)?;
    shared.store.create(def, namespace, body)
}

/// MicroTime fields are stored with exactly six fractional digits, whatever the client sent.
fn normalize_times(def: &ResourceDef, obj: &mut Value) -> Result<(), ApiError> {
    let fields: &[&str] = match def.plural {
        "leases" => &["/spec/renewTime", "/spec/acquireTime"],
        "events" => &["/eventTime"],
        _ => &[],
    };
    for f in fields {
        if let Some(v) = obj.pointer_mut(f) {
            if let Value::String(s) = v {
                let t = meta::parse_rfc3339(s).ok_or_else(|| {
                    ApiError::bad_request(format!("{f}: invalid MicroTime {s:?}"))
                })?;
                let micro = s
                    .split_once('.')
                    .map(|(_, frac)| frac.trim_end_matches('Z'))
                    .filter(|frac| frac.len() == 6 && frac.bytes().all(|b| b.is_ascii_digit()));
                if micro.is_none() {
                    *s = meta::rfc3339_micros(t);
                }
            } else if !v.is_null() {
                return Err(ApiError::bad_request(format!(
                    "{f}: MicroTime must be a string"
                )));
            }
        }
    }
    Ok(())
}

/// The validation a real API server applies that clients most often get wrong.
fn validate(def: &ResourceDef, obj: &Value) -> Result<(), ApiError> {
    let name = store::obj_name(obj).to_string();
    if let Some(refs) = obj.pointer("/metadata/ownerReferences") {
        let refs = refs.as_array().ok_or_else(|| {
            ApiError::invalid(def.kind, &name, "metadata.ownerReferences: must be a list")
        })?;
        for r in refs {
            for field in ["apiVersion", "kind", "name", "uid"] {
                if r.get(field)
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .is_empty()
                {
                    return Err(ApiError::invalid(
                        def.kind,
                        &name,
                        format!("metadata.ownerReferences.{field}: Invalid value: \"\": {field} must not be empty"),
                    ));
                }
            }
        }
    }
    match def.plural {
        "pods" => {
            let containers = obj.pointer("/spec/containers").and_then(Value::as_array);
            match containers {
                Some(cs) if !cs.is_empty() => {
                    for (i, c) in cs.iter().enumerate() {
                        for field in ["name", "image"] {
                            if c.get(field)
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .is_empty()
                            {
                                return Err(ApiError::invalid(
                                    "Pod",
                                    &name,
                                    format!("spec.containers[{i}].{field}: Required value"),
                                ));
                            }
                        }
                    }
                }
                _ => {
                    return Err(ApiError::invalid(
                        "Pod",
                        &name,
                        "spec.containers: Required value",
                    ))
                }
            }
        }
        "leases" => {
            if let Some(d) = obj.pointer("/spec/leaseDurationSeconds") {
                if d.as_i64().is_none_or(|d| d <= 0) {
                    return Err(ApiError::invalid(
                        "Lease",
                        &name,
                        "spec.leaseDurationSeconds: Invalid value: must be greater than 0",
                    ));
                }
            }
        }
        "events" => {
            let io_ns = obj
                .pointer("/involvedObject/namespace")
                .and_then(Value::as_str)
                .unwrap_or("");
            if !io_ns.is_empty() && io_ns != store::obj_namespace(obj) {
                return Err(ApiError::invalid(
                    "Event",
                    &name,
                    "involvedObject.namespace: Invalid value: does not match event.namespace",
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// Pod spec fields an update may change (the rest is immutable, as on a real server).
fn pod_spec_mutable_view(spec: &Value) -> Value {
    let mut v = spec.clone();
    if let Value::Object(m) = &mut v {
        m.remove("activeDeadlineSeconds");
        m.remove("tolerations");
        m.remove("terminationGracePeriodSeconds");
        for list in ["containers", "initContainers"] {
            if let Some(Value::Array(cs)) = m.get_mut(list) {
                for c in cs {
                    if let Value::Object(cm) = c {
                        cm.remove("image");
                    }
                }
            }
        }
    }
    v
}

/// Applies the update rules of the main resource or the status subresource to `new`,
/// given the stored `cur`: system metadata is kept, the other half (status or spec) is reset.
fn update_rules(
    def: &ResourceDef,
    sub: Option<&str>,
    cur: &Value,
    mut new: Value,
) -> Result<Mutation, ApiError> {
    if !new.is_object() {
        return Err(ApiError::bad_request("the object must be a JSON object"));
    }
    let name = store::obj_name(cur).to_string();
    let new_name = store::obj_name(&new);
    if !new_name.is_empty() && new_name != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({new_name}) does not match the name on the URL ({name})"
        )));
    }
    let new_ns = store::obj_namespace(&new);
    if !new_ns.is_empty() && new_ns != store::obj_namespace(cur) {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    check_kind(def, &mut new)?;
    let cur_md = cur.get("metadata").cloned().unwrap_or(json!({}));
    let md = metadata_mut(&mut new);
    for k in [
        "name",
        "namespace",
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "generation",
    ] {
        match cur_md.get(k) {
            Some(v) => md.insert(k.into(), v.clone()),
            None => md.remove(k),
        };
    }
    let has_status = def.subresources.contains(&"status");
    if sub == Some("status") {
        match cur.get("spec") {
            Some(spec) => new["spec"] = spec.clone(),
            None => {
                if let Value::Object(m) = &mut new {
                    m.remove("spec");
                }
            }
        }
        if def.plural == "pods" {
            let owners = cur.pointer("/metadata/ownerReferences").cloned();
            let md = metadata_mut(&mut new);
            match owners {
                Some(o) => md.insert("ownerReferences".into(), o),
                None => md.remove("ownerReferences"),
            };
        }
    } else if has_status {
        match cur.get("status") {
            Some(status) => new["status"] = status.clone(),
            None => {
                if let Value::Object(m) = &mut new {
                    m.remove("status");
                }
            }
        }
        let old_spec = cur.get("spec").cloned().unwrap_or(Value::Null);
        let new_spec = new.get("spec").cloned().unwrap_or(Value::Null);
        if def.plural == "pods"
            && pod_spec_mutable_view(&old_spec) != pod_spec_mutable_view(&new_spec)
        {
            return Err(ApiError::invalid(
                "Pod",
                &name,
                "spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`, \
                 `spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` \
                 (only additions to existing tolerations), `spec.terminationGracePeriodSeconds`",
            ));
        }
        if old_spec != new_spec {
            let gen = cur
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            metadata_mut(&mut new).insert("generation".into(), json!(gen + 1));
        }
    }
    normalize_times(def, &mut new)?;
    validate(def, &new)?;
    // An object being deleted goes once its finalizers are gone (a bound pod additionally
    // waits for its kubelet's grace-0 delete).
    let deleting = new.pointer("/metadata/deletionTimestamp").is_some();
    let finalizers_empty = new
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_none_or(Vec::is_empty);
    let grace_done = def.plural != "pods"
        || new
            .pointer("/metadata/deletionGracePeriodSeconds")
            .and_then(Value::as_i64)
            == Some(0);
    if deleting && finalizers_empty && grace_done {
        return Ok(Mutation::Remove(new));
    }
    Ok(Mutation::Replace(new))
}

/// `metadata.uid` / `metadata.resourceVersion` in a write body are preconditions.
fn check_preconditions(def: &ResourceDef, cur: &Value, body: &Value) -> Result<(), ApiError> {
    let name = store::obj_name(cur);
    let uid = body
        .pointer("/metadata/uid")
        .and_then(Value::as_str)
        .unwrap_or("");
    if !uid.is_empty() && uid != store::obj_uid(cur) {
        return Err(ApiError::conflict_uid(
            def.group,
            def.plural,
            name,
            uid,
            store::obj_uid(cur),
        ));
    }
    let rv = body
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or("");
    if !rv.is_empty() && rv != store::obj_rv(cur) {
        return Err(ApiError::conflict_modified(def.group, def.plural, name));
    }
    Ok(())
}

/// PUT: full replacement with optimistic concurrency on resourceVersion.
pub fn update_object(
    shared: &Shared,
    def: &'static ResourceDef,
    namespace: &str,
    name: &str,
    sub: Option<&str>,
    body: Value,
) -> Result<Value, ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    let body_name = store::obj_name(&body);
    if !body_name.is_empty() && body_name != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    if body
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        == Some("0")
    {
        // Kubernetes 1.35+ rejects the blind "0" version VK used to send.
        return Err(ApiError::invalid(
            def.kind,
            name,
            "metadata.resourceVersion: Invalid value: \"0\": must be specified for an update",
        ));
    }
    let out = shared.store.mutate(def, namespace, name, |cur| {
        check_preconditions(def, cur, &body)?;
        update_rules(def, sub, cur, body.clone())
    })?;
    Ok(out)
}

/// PATCH: applied to the stored object, then the same rules as an update.
#[allow(clippy::too_many_arguments)]
pub fn patch_object(
    shared: &Shared,
    def: &'static ResourceDef,
    namespace: &str,
    name: &str,
    sub: Option<&str>,
    kind: PatchType,
    body: &Value,
) -> Result<Value, ApiError> {
    let out = shared.store.mutate(def, namespace, name, |cur| {
        if kind != PatchType::Json {
            check_preconditions(def, cur, body)?;
        }
        let mut candidate = cur.clone();
        patch::apply(kind, &mut candidate, body)
            .map_err(|e| ApiError::new(422, "Invalid", format!("unable to apply patch: {e}")))?;
        if kind == PatchType::Json {
            check_preconditions(def, cur, &candidate)?;
        }
        update_rules(def, sub, cur, candidate)
    })?;
    Ok(out)
}

/// DeleteOptions from the body and query (the body wins, as on the real server).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeleteOptions {
    pub grace_period_seconds: Option<i64>,
    pub uid: Option<String>,
    pub resource_version: Option<String>,
}

impl DeleteOptions {
    fn from_request(req: &Request) -> Result<DeleteOptions, ApiError> {
        let mut opts = DeleteOptions::default();
        if let Some(g) = req.query("gracePeriodSeconds") {
            opts.grace_period_seconds =
                Some(g.parse().map_err(|_| {
                    ApiError::bad_request(format!("invalid gracePeriodSeconds {g:?}"))
                })?);
        }
        if !req.body.iter().all(u8::is_ascii_whitespace) {
            let body: Value = serde_json::from_slice(&req.body)
                .map_err(|e| ApiError::bad_request(format!("invalid DeleteOptions body: {e}")))?;
            if let Some(g) = body.get("gracePeriodSeconds").filter(|g| !g.is_null()) {
                opts.grace_period_seconds = Some(g.as_i64().ok_or_else(|| {
                    ApiError::bad_request("gracePeriodSeconds must be an integer")
                })?);
            }
            if let Some(p) = body.get("preconditions") {
                opts.uid = p.get("uid").and_then(Value::as_str).map(str::to_string);
                opts.resource_version = p
                    .get("resourceVersion")
                    .and_then(Value::as_str)
                    .map(str::to_string);
            }
        }
        Ok(opts)
    }
}

/// DELETE. A bound, non-terminal pod deleted with grace > 0 only gets deletionTimestamp and
/// deletionGracePeriodSeconds (its kubelet confirms with grace 0); everything else goes at once
/// unless finalizers hold it.
pub fn delete_object(
    shared: &Shared,
    def: &'static ResourceDef,
    namespace: &str,
    name: &str,
    opts: &DeleteOptions,
) -> Result<Value, ApiError> {
    let out = shared.store.mutate(def, namespace, name, |cur| {
        if let Some(uid) = opts.uid.as_deref() {
            if uid != store::obj_uid(cur) {
                return Err(ApiError::conflict_uid(
                    def.group,
                    def.plural,
                    name,
                    uid,
                    store::obj_uid(cur),
                ));
            }
        }
        if let Some(rv) = opts.resource_version.as_deref() {
            if rv != store::obj_rv(cur) {
                return Err(ApiError::conflict_modified(def.group, def.plural, name));
            }
        }
        let has_finalizers = cur
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty());
        let mut grace = 0;
        if def.plural == "pods" {
            let bound = !cur
                .pointer("/spec/nodeName")
                .and_then(Value::as_str)
                .unwrap_or("")
                .is_empty();
            let terminal = matches!(
                cur.pointer("/status/phase").and_then(Value::as_str),
                Some("Succeeded" | "Failed")
            );
            grace = opts.grace_period_seconds.unwrap_or_else(|| {
                cur.pointer("/spec/terminationGracePeriodSeconds")
                    .and_then(Value::as_i64)
                    .unwrap_or(30)
            });
            if !bound || terminal || grace < 0 {
                grace = 0;
            }
        }
        if grace == 0 && !has_finalizers {
            return Ok(Mutation::Remove(cur.clone()));
        }
        let existing = cur
            .pointer("/metadata/deletionGracePeriodSeconds")
            .and_then(Value::as_i64);
        let mut new = cur.clone();
        if existing.is_some_and(|e| e <= grace) {
            // Already terminating with a shorter or equal grace: nothing changes.
            return Ok(Mutation::Replace(new));
        }
        let at = SystemTime::now() + Duration::from_secs(grace as u64);
        let md = metadata_mut(&mut new);
        md.insert("deletionTimestamp".into(), json!(meta::rfc3339(at)));
        md.insert("deletionGracePeriodSeconds".into(), json!(grace));
        Ok(Mutation::Replace(new))
    })?;
    Ok(out)
}

fn token_review(shared: &Shared, mut body: Value) -> Value {
    let token = body
        .pointer("/spec/token")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let audiences = body.pointer("/spec/audiences").cloned();
    let user = shared.token_user(&token);
    let mut status = match user {
        Some(u) => json!({
            "authenticated": true,
            "user": {"username": u.username, "uid": u.uid, "groups": u.groups},
        }),
        None => {
            json!({"authenticated": false, "error": "token not recognised by the fake API server"})
        }
    };
    if let Some(a) = audiences {
        status["audiences"] = a;
    }
    body["kind"] = json!("TokenReview");
    body["apiVersion"] = json!("authentication.k8s.io/v1");
    body["status"] = status;
    body
}

fn access_review(shared: &Shared, mut body: Value) -> Value {
    let spec = body.get("spec").cloned().unwrap_or(json!({}));
    let (allowed, reason) = shared.review_access(&spec);
    body["kind"] = json!("SubjectAccessReview");
    body["apiVersion"] = json!("authorization.k8s.io/v1");
    body["status"] = json!({"allowed": allowed, "reason": reason});
    body
}

/// A SelfSubjectAccessReview: allowed unless the RBAC knob denies its verb and resource.
fn self_access_review(shared: &Shared, mut body: Value) -> Value {
    let attrs = body
        .pointer("/spec/resourceAttributes")
        .cloned()
        .unwrap_or(json!({}));
    let field = |k: &str| {
        attrs
            .get(k)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let (verb, resource, sub) = (field("verb"), field("resource"), field("subresource"));
    let resource = if sub.is_empty() {
        resource
    } else {
        format!("{resource}/{sub}")
    };
    let status = if shared.denies(&verb, &resource) {
        json!({"allowed": false, "reason": format!("RBAC: {verb} {resource} is not granted")})
    } else {
        json!({"allowed": true, "reason": "RBAC: allowed by the fake API server"})
    };
    body["kind"] = json!("SelfSubjectAccessReview");
    body["apiVersion"] = json!("authorization.k8s.io/v1");
    body["status"] = status;
    body
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
