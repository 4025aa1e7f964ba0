//! The gate of a fresh bring-up on a source the pod names that the host would reach: an
//! http(s) image URL (the `sources` rules; a host name is resolved by the daemon off the loop)
//! and a clone-from-dir (below VK_CLONE_FROM_DIR_ROOT; the daemon walks it for symlinks).
//!
//! A broken rule fails the pod for good (phase Failed, a Warning naming the rule, the lifecycle
//! counter with the rule's reason) before anything fetches from the source; an answer the host
//! could not give (a resolver error) fails the create with a retry, as other bring-up errors do.

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

impl Provider {
    /// Whether the bring-up may start now. When the source needs the host's look first, the
    /// create waits for it in `CreateStep::SourceCheck`; a refused source has failed the pod.
    pub(super) fn source_gate(&mut self, key: &PodKey, c: &CreateOp) -> bool {
        let spec = &c.spec;
        if let Some(dir) = &spec.clone_from_dir {
            let rule = SourceRule::CloneDir;
            let root = self.cfg.clone_from_dir_root.clone();
            if let Err(msg) = sources::check_clone_dir(dir, root.as_deref()) {
                self.fail_create_with(key, &c.uid, &msg, rule.failure());
                return false;
            }
            let check = SourceCheck::CloneDir {
                dir: dir.clone(),
                root: root.unwrap_or_default(),
            };
            let ask = Ask::effect(|op| Effect::CheckSource { op, check });
            self.advance(key, CreateStep::SourceCheck { rule }, ask);
            return false;
        }
        let runs_url = spec.mode == Mode::Run
            && spec.clone_from_dir.is_none()
            && spec.fork_from.is_empty()
            && spec::is_http_url(&spec.image);
        if !runs_url {
            return true;
        }
        let rule = SourceRule::ImageUrl;
        match sources::check_image_url(&spec.image, &self.cfg.image_url_allow_hosts) {
            ImageUrl::Allowed => true,
            ImageUrl::Refused(msg) => {
                self.fail_create_with(key, &c.uid, &msg, rule.failure());
                false
            }
            ImageUrl::Resolve { host } => {
                let check = SourceCheck::ImageHost {
                    url: spec.image.clone(),
                    host,
                };
                let ask = Ask::effect(|op| Effect::CheckSource { op, check });
                self.advance(key, CreateStep::SourceCheck { rule }, ask);
                false
            }
        }
    }

    /// The host's verdict on the source: the bring-up goes on, or the pod fails.
    pub(super) fn source_checked(
        &mut self,
        key: &PodKey,
        c: &CreateOp,
        rule: SourceRule,
        verdict: SourceVerdict,
    ) {
        match verdict {
            SourceVerdict::Allowed => self.bring_up_from_source(key, c),
            SourceVerdict::Refused(msg) => self.fail_create_with(key, &c.uid, &msg, rule.failure()),
            SourceVerdict::Unavailable(msg) => self.fail_create(key, &c.uid, &msg, true),
        }
    }
}
