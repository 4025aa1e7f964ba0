//! The fake API server's reviews: TokenReview, SubjectAccessReview and
//! SelfSubjectAccessReview, answered from the server's users and rules.

use serde_json::{json, Value};

use super::super::Shared;

pub(super) fn token_review(shared: &Shared, mut body: Value) -> Value {
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

pub(super) fn access_review(shared: &Shared, mut body: Value) -> Value {
    let spec = body.get("spec").cloned().unwrap_or(json!({}));
    let (allowed, reason) = shared.review_access(&spec);
    body["kind"] = json!("SubjectAccessReview");
    body["apiVersion"] = json!("authorization.k8s.io/v1");
    body["status"] = json!({"allowed": allowed, "reason": reason});
    body
}

/// A SelfSubjectAccessReview: allowed unless the RBAC knob denies its verb and resource.
pub(super) fn self_access_review(shared: &Shared, mut body: Value) -> Value {
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
