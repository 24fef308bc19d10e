//! sglang's environment variables: the source they are read from
//! ([`Vars`]: the process environment, or a map in tests) and their
//! parsing, lenient as sglang's (a malformed value is ignored with a
//! warning, never fatal at start).

/// Reads a setting by its environment variable name (the process
/// environment, or a map in tests).
pub type Vars<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process environment as [`Vars`].
pub(crate) fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Whether sglang's environment selects the intra-node NVLink transport
/// (the reference's `_nvlink_intra_transport_active`: either variable set to
/// anything non-empty, or the protocol named).
pub fn nvlink_intra_env() -> bool {
    nvlink_intra_vars(&|name| std::env::var(name).ok())
}

/// [`nvlink_intra_env`] over any variable source.
pub fn nvlink_intra_vars(get: Vars<'_>) -> bool {
    let set = |name: &str| get(name).is_some_and(|v| !v.is_empty());
    if set("MC_INTRANODE_NVLINK") || set("MC_INTRA_NVLINK") {
        return true;
    }
    let proto = get("MOONCAKE_PROTOCOL").unwrap_or_default();
    matches!(
        proto.trim().to_ascii_lowercase().as_str(),
        "nvlink_intra" | "nvlink-intra" | "intra_nvlink"
    )
}

/// Parses an environment variable, ignoring it (with a warning) when it is
/// malformed rather than failing start-up on a typo.
pub(crate) fn env<T: std::str::FromStr>(get: Vars<'_>, name: &str) -> Option<T> {
    let raw = get(name)?;
    match raw.trim().parse() {
        Ok(v) => Some(v),
        Err(_) => {
            tracing::warn!(variable = name, value = %raw, "ignoring malformed environment variable");
            None
        }
    }
}

/// Parses a boolean environment variable (`1/true/yes/on`, `0/false/no/off`,
/// empty), ignoring a malformed one with a warning.
pub(crate) fn env_bool(get: Vars<'_>, name: &str) -> Option<bool> {
    let raw = get(name)?;
    match raw.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" | "" => Some(false),
        _ => {
            tracing::warn!(variable = name, value = %raw, "ignoring malformed boolean environment variable");
            None
        }
    }
}
