//! The SNAPSHOT_* push knobs: compression level, chunk size, concurrency, memory budget.
//! All-zero zstd and chunk select the exact v1 writer.

use super::MIB;
use crate::snapshots::TransferError;

/// The SNAPSHOT_* knobs. All-zero zstd and chunk = the exact v1 writer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushKnobs {
    /// `SNAPSHOT_ZSTD_LEVEL`; 0 = no compression.
    pub zstd_level: i32,
    /// `SNAPSHOT_CHUNK_SIZE_MIB` in bytes; 0 = no chunking.
    pub chunk_size: u64,
    /// `SNAPSHOT_TRANSFER_CONCURRENCY` (default 8).
    pub concurrency: usize,
    /// `SNAPSHOT_MEMORY_BUDGET_MIB` in bytes (default 9216 MiB).
    pub memory_budget: u64,
}

impl Default for PushKnobs {
    fn default() -> Self {
        PushKnobs {
            zstd_level: 0,
            chunk_size: 0,
            concurrency: 8,
            memory_budget: 9216 * MIB,
        }
    }
}

fn env_nonneg(name: &str) -> Option<u64> {
    // Invalid or negative → 0.
    std::env::var(name)
        .ok()
        .map(|v| v.trim().parse::<i64>().ok().filter(|n| *n > 0).unwrap_or(0) as u64)
}

impl PushKnobs {
    /// Reads the knobs from the environment.
    pub fn from_env() -> Self {
        let d = PushKnobs::default();
        PushKnobs {
            zstd_level: env_nonneg("SNAPSHOT_ZSTD_LEVEL")
                .map(|v| v.min(22) as i32)
                .unwrap_or(0),
            chunk_size: env_nonneg("SNAPSHOT_CHUNK_SIZE_MIB")
                .map(|v| v.min(4096) * MIB)
                .unwrap_or(0),
            concurrency: env_nonneg("SNAPSHOT_TRANSFER_CONCURRENCY")
                .filter(|v| *v > 0)
                .map(|v| v as usize)
                .unwrap_or(d.concurrency),
            memory_budget: env_nonneg("SNAPSHOT_MEMORY_BUDGET_MIB")
                .filter(|v| *v > 0)
                .map(|v| v * MIB)
                .unwrap_or(d.memory_budget),
        }
    }

    /// True when the v2-capable writer is active (the node-wide push gate applies).
    pub fn pipelined(&self) -> bool {
        self.zstd_level > 0 || self.chunk_size > 0
    }

    /// Chunk workers: min(concurrency, floor(budget / (2 × chunk)) − 1), at least 1.
    pub fn workers(&self) -> usize {
        if self.chunk_size == 0 {
            return 1;
        }
        let by_budget = (self.memory_budget / (2 * self.chunk_size)).saturating_sub(1) as usize;
        self.concurrency.min(by_budget).max(1)
    }

    pub(super) fn validate(&self) -> Result<(), TransferError> {
        if self.chunk_size > 4096 * MIB {
            return Err(TransferError::Invalid(format!(
                "chunk size {} MiB exceeds 4096 MiB",
                self.chunk_size / MIB
            )));
        }
        if self.chunk_size > 0 && 4 * self.chunk_size > self.memory_budget {
            return Err(TransferError::Invalid(format!(
                "chunk size {} MiB needs a memory budget of at least {} MiB (have {} MiB)",
                self.chunk_size / MIB,
                4 * self.chunk_size / MIB,
                self.memory_budget / MIB
            )));
        }
        Ok(())
    }

    /// zstd level the Go library's four speed classes correspond to.
    pub(super) fn zstd_native_level(&self) -> i32 {
        match self.zstd_level {
            l if l < 3 => 1,
            3..=5 => 3,
            6..=9 => 7,
            _ => 11,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knob_arithmetic() {
        let k = PushKnobs {
            zstd_level: 3,
            chunk_size: 64 * MIB,
            concurrency: 8,
            memory_budget: 9216 * MIB,
        };
        assert_eq!(k.workers(), 8);
        let k = PushKnobs {
            chunk_size: 64 * MIB,
            memory_budget: 512 * MIB,
            ..k
        };
        assert_eq!(k.workers(), 3);
        assert!(k.validate().is_ok());
        let k = PushKnobs {
            chunk_size: 256 * MIB,
            memory_budget: 512 * MIB,
            ..k
        };
        assert!(k.validate().is_err());
        assert!(!PushKnobs::default().pipelined());
    }
}
