//! Small helpers for error messages.

/// `error` followed by each of its sources, `: `-separated: the whole story
/// in one line (many library errors keep the OS error only as a source).
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn chain_includes_sources_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("loading failed")]
        struct Outer(#[source] std::io::Error);
        let error = Outer(std::io::Error::other("invalid argument"));
        assert_eq!(super::chain(&error), "loading failed: invalid argument");
    }
}
