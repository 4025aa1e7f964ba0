//! The OCI registry client: references, auth, snapshot and cloud-image push and pull.
//! Blocking transfers that run on the worker pool, never on the loop thread.
