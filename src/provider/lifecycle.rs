//! The lifecycle annotation triple (state, generation, message): per-pod intent,
//! acceptance rules (generation, sticky failure, incarnation) and the patch it flushes to.

use std::collections::BTreeMap;

use super::spec::{ANN_LIFECYCLE_GEN, ANN_LIFECYCLE_MSG, ANN_LIFECYCLE_STATE};
use super::truncate_bytes;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Creating,
    Ready,
    Hibernating,
    Hibernated,
    Failed,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Creating => "creating",
            State::Ready => "ready",
            State::Hibernating => "hibernating",
            State::Hibernated => "hibernated",
            State::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<State> {
        Some(match s {
            "creating" => State::Creating,
            "ready" => State::Ready,
            "hibernating" => State::Hibernating,
            "hibernated" => State::Hibernated,
            "failed" => State::Failed,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intent {
    pub uid: String,
    pub state: State,
    pub generation: i64,
    pub message: String,
    /// The annotations on the API object already say this.
    pub flushed: bool,
}

impl Intent {
    /// The merge patch of the triple; an empty message deletes the message key.
    pub fn patch(&self) -> BTreeMap<String, Option<String>> {
        let mut m = BTreeMap::new();
        m.insert(
            ANN_LIFECYCLE_STATE.to_string(),
            Some(self.state.as_str().into()),
        );
        m.insert(
            ANN_LIFECYCLE_GEN.to_string(),
            Some(self.generation.to_string()),
        );
        m.insert(
            ANN_LIFECYCLE_MSG.to_string(),
            if self.message.is_empty() {
                None
            } else {
                Some(self.message.clone())
            },
        );
        m
    }

    /// Seed from a pod's current annotations, marked flushed (startup reconcile).
    pub fn seed(uid: &str, annotations: &BTreeMap<String, String>) -> Option<Intent> {
        let state = State::parse(annotations.get(ANN_LIFECYCLE_STATE)?)?;
        Some(Intent {
            uid: uid.into(),
            state,
            generation: annotations
                .get(ANN_LIFECYCLE_GEN)
                .and_then(|g| g.parse().ok())
                .unwrap_or(0),
            message: annotations
                .get(ANN_LIFECYCLE_MSG)
                .cloned()
                .unwrap_or_default(),
            flushed: true,
        })
    }
}

/// Decide whether setting `state` for incarnation `uid` at generation `generation` is accepted
/// given the current intent; returns the new intent or None when the write is dropped.
/// (The "tracked pod has another UID" rule is checked by the caller.)
pub fn apply(
    current: Option<&Intent>,
    uid: &str,
    state: State,
    generation: i64,
    message: &str,
) -> Option<Intent> {
    let message = truncate_bytes(message, 4096);
    let mut generation = generation;
    if let Some(cur) = current {
        if cur.uid == uid {
            if generation < cur.generation {
                return None;
            }
            generation = generation.max(cur.generation);
            if cur.state == State::Failed
                && generation == cur.generation
                && !matches!(state, State::Failed | State::Creating | State::Hibernating)
            {
                return None;
            }
            if cur.state == state && cur.generation == generation && cur.message == message {
                return Some(cur.clone());
            }
        }
    }
    Some(Intent {
        uid: uid.into(),
        state,
        generation,
        message,
        flushed: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_failure_at_same_generation() {
        let failed = apply(None, "u", State::Failed, 2, "boom").unwrap();
        assert!(apply(Some(&failed), "u", State::Ready, 2, "").is_none());
        assert!(apply(Some(&failed), "u", State::Creating, 2, "").is_some());
        assert_eq!(
            apply(Some(&failed), "u", State::Ready, 3, "")
                .unwrap()
                .state,
            State::Ready
        );
    }

    #[test]
    fn lower_generation_is_dropped_and_other_uid_replaces() {
        let cur = apply(None, "u", State::Ready, 5, "").unwrap();
        assert!(apply(Some(&cur), "u", State::Creating, 4, "").is_none());
        let other = apply(Some(&cur), "v", State::Creating, 0, "").unwrap();
        assert_eq!(other.uid, "v");
        assert_eq!(other.generation, 0);
    }

    #[test]
    fn unchanged_write_keeps_flushed_marker() {
        let mut cur = apply(None, "u", State::Ready, 1, "").unwrap();
        cur.flushed = true;
        assert!(apply(Some(&cur), "u", State::Ready, 1, "").unwrap().flushed);
        assert!(!apply(Some(&cur), "u", State::Ready, 2, "").unwrap().flushed);
    }

    #[test]
    fn patch_deletes_empty_message_and_seed_roundtrips() {
        let i = apply(None, "u", State::Creating, 7, "").unwrap();
        let p = i.patch();
        assert_eq!(p[ANN_LIFECYCLE_STATE].as_deref(), Some("creating"));
        assert_eq!(p[ANN_LIFECYCLE_GEN].as_deref(), Some("7"));
        assert_eq!(p[ANN_LIFECYCLE_MSG], None);
        let ann: BTreeMap<String, String> = p
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| (k, v)))
            .collect();
        let s = Intent::seed("u", &ann).unwrap();
        assert_eq!(
            (s.state, s.generation, s.flushed),
            (State::Creating, 7, true)
        );
        let long = "x".repeat(5000);
        assert_eq!(
            apply(None, "u", State::Failed, 0, &long)
                .unwrap()
                .message
                .len(),
            4096
        );
    }
}
