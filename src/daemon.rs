//! The edge: wires the reactor, the kube client and the provider core, and performs effects.
//! The only place where decisions meet I/O.
