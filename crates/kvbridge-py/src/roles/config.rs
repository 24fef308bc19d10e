//! The role settings the Python shell derives from sglang's server
//! arguments and environment (`docs/sglang.md`, "kvbridge backend"),
//! parsed into [`PrefillConfig`] / [`DecodeConfig`].
//!
//! The shell sends the configuration as JSON in the roles' own field names;
//! every key must be one the configuration has (a typo or a renamed field
//! fails start-up instead of being ignored), and the cluster secret comes
//! only from the environment (`KVBRIDGE_SECRET_FILE` / `KVBRIDGE_SECRET`),
//! never from the JSON.
//!
//! **Never:** reads sglang's environment variables itself (the shell reads
//! them with sglang's own parsers, so both agree on every value).

use kvbridge_engine::ClusterSecret;
use kvbridge_roles::{ConfigError, DecodeConfig, PrefillConfig};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Older names the configurations still read (serde aliases), as dotted
/// paths, and the field each one names now.
const ALIASES: &[(&str, &str)] = &[("staging.enabled", "mode")];

/// Keys of `given` that `defaults` (a configuration serialized) does not
/// have, as dotted paths, nested objects included.
fn unknown_keys(given: &Value, defaults: &Value, prefix: &str, out: &mut Vec<String>) {
    let (Value::Object(given), Value::Object(known)) = (given, defaults) else {
        return;
    };
    for (key, value) in given {
        let path = format!("{prefix}{key}");
        let field = ALIASES
            .iter()
            .find(|(alias, _)| path == *alias)
            .map_or(key.as_str(), |(_, now)| now);
        match known.get(field) {
            None => out.push(path),
            Some(default) => unknown_keys(value, default, &format!("{path}."), out),
        }
    }
}

/// `text` as a `T`, refusing keys `T` does not have.
fn parse_checked<T: Serialize + DeserializeOwned + Default>(
    what: &str,
    text: &str,
) -> Result<T, ConfigError> {
    let bad = |e: String| ConfigError::Setting(format!("{what} configuration: {e}"));
    let given: Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
    if !given.is_object() {
        return Err(bad("not a JSON object".into()));
    }
    let defaults = serde_json::to_value(T::default()).map_err(|e| bad(e.to_string()))?;
    let mut unknown = Vec::new();
    unknown_keys(&given, &defaults, "", &mut unknown);
    if !unknown.is_empty() {
        return Err(bad(format!("unknown keys {}", unknown.join(", "))));
    }
    serde_json::from_value(given).map_err(|e| bad(e.to_string()))
}

/// A prefill configuration from the shell's JSON, with `secret`.
pub fn prefill_config(
    text: &str,
    secret: Option<ClusterSecret>,
) -> Result<PrefillConfig, ConfigError> {
    let mut c: PrefillConfig = parse_checked("prefill", text)?;
    c.worker_layout().map_err(ConfigError::Setting)?;
    if c.probe.enabled && (c.probe.interval.is_zero() || c.probe.interval > c.probe.max_interval) {
        return Err(ConfigError::Setting(
            "Need 0 < SGLANG_FAILED_SESSION_PROBE_INTERVAL_S <= \
             SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S"
                .into(),
        ));
    }
    if c.probe.enabled && c.probe.idle_timeout.is_zero() {
        return Err(ConfigError::Setting(
            "SGLANG_FAILED_SESSION_IDLE_TIMEOUT_S must be positive".into(),
        ));
    }
    c.nvlink_intra |= kvbridge_roles::nvlink_intra_env();
    c.secret = secret;
    Ok(c)
}

/// A decode configuration from the shell's JSON, with `secret`.
pub fn decode_config(
    text: &str,
    secret: Option<ClusterSecret>,
) -> Result<DecodeConfig, ConfigError> {
    let mut c: DecodeConfig = parse_checked("decode", text)?;
    // sglang's floors: heartbeats at least 2 s apart, at least one failure.
    c.heartbeat_interval = c.heartbeat_interval.max(std::time::Duration::from_secs(2));
    c.heartbeat_max_failures = c.heartbeat_max_failures.max(1);
    c.nvlink_intra |= kvbridge_roles::nvlink_intra_env();
    c.secret = secret;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn known_keys_are_applied() {
        let c = prefill_config(
            r#"{"local_ip": "10.0.0.2", "bootstrap_addr": "10.0.0.1:8998",
                "rank": {"attn_tp_size": 2, "attn_tp_rank": 1},
                "bootstrap_timeout": 1.5, "queue_size": 2, "thread_pool_size": 4,
                "probe": {"interval": 3.0}}"#,
            None,
        )
        .unwrap();
        assert_eq!(c.local_ip, "10.0.0.2");
        assert_eq!(c.rank.attn_tp_size, 2);
        assert_eq!(c.rank.attn_tp_rank, 1);
        assert_eq!(c.rank.pp_size, 1);
        assert_eq!(c.bootstrap_timeout, Duration::from_millis(1500));
        assert_eq!(c.probe.interval, Duration::from_secs(3));
        assert_eq!(c.worker_layout(), Ok((2, 2)));
    }

    #[test]
    fn unknown_keys_are_refused_with_their_path() {
        let e = prefill_config(r#"{"bootstrap_timout": 1}"#, None).unwrap_err();
        assert!(e.to_string().contains("bootstrap_timout"), "{e}");
        let e = prefill_config(r#"{"rank": {"tp": 1}}"#, None).unwrap_err();
        assert!(e.to_string().contains("rank.tp"), "{e}");
        let e = decode_config(r#"{"queue_size": 4}"#, None).unwrap_err();
        assert!(e.to_string().contains("queue_size"), "{e}");
        let e = decode_config("[]", None).unwrap_err();
        assert!(e.to_string().contains("object"), "{e}");
    }

    #[test]
    fn sglang_rules_are_enforced() {
        let e = prefill_config(r#"{"queue_size": 4, "thread_pool_size": 2}"#, None).unwrap_err();
        assert!(e.to_string().contains("THREAD_POOL_SIZE"), "{e}");
        let e =
            prefill_config(r#"{"probe": {"interval": 10, "max_interval": 5}}"#, None).unwrap_err();
        assert!(e.to_string().contains("PROBE_INTERVAL"), "{e}");
        let c = prefill_config(r#"{"probe": {"enabled": false, "interval": 0}}"#, None).unwrap();
        assert!(!c.probe.enabled);
        let c = decode_config(
            r#"{"heartbeat_interval": 0.5, "heartbeat_max_failures": 0}"#,
            None,
        )
        .unwrap();
        assert_eq!(c.heartbeat_interval, Duration::from_secs(2));
        assert_eq!(c.heartbeat_max_failures, 1);
    }

    #[test]
    fn staging_takes_its_mode_or_the_older_enabled_flag() {
        use kvbridge_roles::StagingMode;
        let mode = |text: &str| decode_config(text, None).map(|c| c.staging.mode).ok();
        assert_eq!(mode("{}"), Some(StagingMode::Auto));
        assert_eq!(
            mode(r#"{"staging": {"enabled": true}}"#),
            Some(StagingMode::On)
        );
        assert_eq!(
            mode(r#"{"staging": {"enabled": false}}"#),
            Some(StagingMode::Off)
        );
        assert_eq!(
            mode(r#"{"staging": {"mode": "auto"}}"#),
            Some(StagingMode::Auto)
        );
        let e = prefill_config(r#"{"staging": {"enabeld": true}}"#, None).unwrap_err();
        assert!(e.to_string().contains("staging.enabeld"), "{e}");
    }

    #[test]
    fn negative_durations_are_refused() {
        let e = decode_config(r#"{"waiting_timeout": -1}"#, None).unwrap_err();
        assert!(e.to_string().contains("decode configuration"), "{e}");
    }
}
