//! The Kubernetes API client: credentials, blocking calls on ureq, the non-blocking pod watch, Events.
//! It knows the wire rules, not what vk-cocoon decides.
