//! The Kubernetes API client: credentials, blocking calls on ureq, the non-blocking pod watch, Events.
//! It knows the wire rules, not what vk-cocoon decides.

pub mod auth;
pub mod client;
pub mod error;
pub mod events;
pub mod kubeconfig;
pub mod ratelimit;
pub mod tls;
pub mod watch;

pub use client::{Client, PodList, ServerTarget, ServerUrlError, WatchSession};
pub use error::{ApiStatus, KubeError};
pub use events::{EventRecorder, EventType};
pub use kubeconfig::{ClusterConfig, KubeConfigError, KubeOptions};
pub use watch::{PodWatch, WatchConfig, WatchOutput};
