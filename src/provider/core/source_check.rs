//! The gate of a fresh bring-up on a source the pod names that the host would reach: an
//! http(s) image URL (the `sources` rules; a host name is resolved by the daemon off the loop)
//! and a clone-from-dir (below VK_CLONE_FROM_DIR_ROOT; the daemon walks it for symlinks).
//!
//! A broken rule fails the pod for good (phase Failed, a Warning naming the rule, the lifecycle
//! counter with the rule's reason) before anything fetches from the source; an answer the host
//! could not give (a resolver error) fails the create with a retry, as other bring-up errors do.

use super::create::{CreateNext, CreateThen};
use super::*;
use crate::provider::sources::{self, ImageUrl};

/// The rule a source passes: what a refusal is called in Events and in
/// `vk_cocoon_pod_lifecycle_total{reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::provider::core) enum SourceRule {
    /// An http(s) image URL's host (VK_IMAGE_URL_ALLOW_HOSTS).
    ImageUrl,
    /// A clone-from-dir directory (VK_CLONE_FROM_DIR_ROOT).
    CloneDir,
}

impl SourceRule {
    fn failure(self) -> CreateFailure {
        let (reason, metric_reason) = match self {
            SourceRule::ImageUrl => ("ImageURLRefused", "image_url_refused"),
            SourceRule::CloneDir => ("CloneFromDirRefused", "clone_dir_refused"),
        };
        CreateFailure {
            reason,
            metric_reason,
            retry: false,
            terminal: true,
        }
    }
}

impl CreateOp {
    /// The gate of the fresh bring-up: `None` when it may start now; otherwise the wait for
    /// the host's look at the source (`CreateStep::SourceCheck`), or the refusal.
    pub(super) fn source_gate(&self, cx: &Cx) -> Option<CreateNext> {
        let spec = &self.spec;
        let refused = |msg: String, rule: SourceRule| {
            Some(Next::Then(CreateThen::Failed(msg, rule.failure())))
        };
        if let Some(dir) = &spec.clone_from_dir {
            let rule = SourceRule::CloneDir;
            let root = cx.cfg.clone_from_dir_root.clone();
            if let Err(msg) = sources::check_clone_dir(dir, root.as_deref()) {
                return refused(msg, rule);
            }
            let check = SourceCheck::CloneDir {
                dir: dir.clone(),
                root: root.unwrap_or_default(),
            };
            let ask = Ask::effect(|op| Effect::CheckSource { op, check });
            return Some(Next::Ask(CreateStep::SourceCheck { rule }, ask));
        }
        let runs_url = spec.mode == Mode::Run
            && spec.clone_from_dir.is_none()
            && spec.fork_from.is_empty()
            && spec::is_http_url(&spec.image);
        if !runs_url {
            return None;
        }
        let rule = SourceRule::ImageUrl;
        match sources::check_image_url(&spec.image, &cx.cfg.image_url_allow_hosts) {
            ImageUrl::Allowed => None,
            ImageUrl::Refused(msg) => refused(msg, rule),
            ImageUrl::Resolve { host } => {
                let check = SourceCheck::ImageHost {
                    url: spec.image.clone(),
                    host,
                };
                let ask = Ask::effect(|op| Effect::CheckSource { op, check });
                Some(Next::Ask(CreateStep::SourceCheck { rule }, ask))
            }
        }
    }

    /// The host's verdict on the source: the bring-up goes on, or the pod fails.
    pub(super) fn source_checked(
        &mut self,
        cx: &Cx,
        rule: SourceRule,
        verdict: SourceVerdict,
    ) -> CreateNext {
        match verdict {
            SourceVerdict::Allowed => self.bring_up_from_source(cx),
            SourceVerdict::Refused(msg) => Next::Then(CreateThen::Failed(msg, rule.failure())),
            SourceVerdict::Unavailable(msg) => Self::failed(msg, true),
        }
    }
}
