//! Names of the globals the agent sets when it loads the programs.

/// `u8`: the most verbose aya-log level the programs emit.
pub const LOG_LEVEL: &str = "AYA_LOG_LEVEL";
/// `u8`: non-zero to log connection starts (debug level) from TC egress.
pub const LOG_CONNECTIONS: &str = "LOG_CONNECTIONS";
