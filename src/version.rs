//! Build metadata: version, git revision and build time baked in by the build script.
//! Nothing here reads the environment at run time.

/// The crate version from Cargo.toml.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Short git revision of the source tree at build time (`unknown` outside git).
pub const GIT_REVISION: &str = env!("VK_GIT_REVISION");

/// Build time as seconds since the epoch (`SOURCE_DATE_EPOCH` when set, for reproducible builds).
pub const BUILD_EPOCH: &str = env!("VK_BUILD_EPOCH");

/// Build time as an RFC 3339 UTC timestamp.
pub fn build_time() -> String {
    let secs: u64 = BUILD_EPOCH.parse().unwrap_or(0);
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
    crate::rfc3339::seconds(t)
}

/// `vk-cocoon 0.1.0 (rev 0123abcd, built 2026-04-01T12:00:00Z)`
pub fn long_version() -> String {
    format!(
        "vk-cocoon {VERSION} (rev {GIT_REVISION}, built {})",
        build_time()
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn build_metadata_is_present() {
        assert!(!super::GIT_REVISION.is_empty());
        let t = super::build_time();
        assert!(
            t.len() == 20 && t.ends_with('Z') && t.as_bytes()[10] == b'T',
            "{t}"
        );
        assert!(super::BUILD_EPOCH.parse::<u64>().unwrap() > 1_600_000_000);
        assert!(super::long_version().starts_with(&format!("vk-cocoon {} (rev ", super::VERSION)));
    }
}
