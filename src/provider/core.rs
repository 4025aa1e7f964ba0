//! The provider state machine: per-pod create / delete / status / eviction and startup reconcile.
//! Pure: `handle(input, now, wall)` returns effects; no clock, file or socket is touched here.

use std::time::{Instant, SystemTime};

use super::{Effect, Input, ProviderConfig};

pub struct Provider {
    #[allow(dead_code)]
    config: ProviderConfig,
}

impl Provider {
    pub fn new(config: ProviderConfig) -> Self {
        Provider { config }
    }

    pub fn handle(&mut self, _input: Input, _now: Instant, _wall: SystemTime) -> Vec<Effect> {
        Vec::new()
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        None
    }
}
