//! The virtual Node object: labels, taints, capacity and allocatable, Lease heartbeat, node status.
//! Builds objects and schedules; the API calls go through kube.
