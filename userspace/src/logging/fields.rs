//! Text log fields without colours, written as tracing-subscriber's default
//! writes them (`name=value` separated by spaces, the message bare, its
//! terminal control characters escaped) but without its styling: the
//! default paints every field's name and `=` through `nu_ansi_term` even
//! when colours are off, and escapes the message one `write_char` at a
//! time. Both are paid on every access line: ≈ 5k instructions of a
//! connection's ≈ 150k on each side (issue 35, docs/BENCHMARKS.md).
//!
//! Used only when colours are off (a log file, a pipe): at a terminal the
//! default formatter's colours stay.

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing_subscriber::{
    field::{MakeVisitor, VisitFmt, VisitOutput},
    fmt::format::Writer,
};

/// The fields formatter (`fmt::layer().fmt_fields(PlainFields)`).
pub(crate) struct PlainFields;

impl<'a> MakeVisitor<Writer<'a>> for PlainFields {
    type Visitor = PlainVisitor<'a>;

    fn make_visitor(&self, writer: Writer<'a>) -> PlainVisitor<'a> {
        PlainVisitor {
            writer,
            first: true,
            result: Ok(()),
        }
    }
}

pub(crate) struct PlainVisitor<'a> {
    writer: Writer<'a>,
    first: bool,
    result: fmt::Result,
}

impl PlainVisitor<'_> {
    fn separate(&mut self) {
        if self.first {
            self.first = false;
        } else {
            self.result = self.writer.write_char(' ');
        }
    }

    /// `name="value"` for a value `Debug` would not escape.
    fn record_quoted(&mut self, field: &Field, value: &str) {
        let name = field.name();
        if self.result.is_err() || name.starts_with("log.") {
            return;
        }
        self.separate();
        if self.result.is_err() {
            return;
        }
        let name = name.strip_prefix("r#").unwrap_or(name);
        let w = &mut self.writer;
        self.result = w
            .write_str(name)
            .and_then(|()| w.write_str("=\""))
            .and_then(|()| w.write_str(value))
            .and_then(|()| w.write_char('"'));
    }
}

impl Visit for PlainVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.record_debug(field, &format_args!("{value}"));
        } else if value
            .bytes()
            .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
        {
            // What `{value:?}` writes for it, without `Debug`'s escaping
            // one char at a time (about half the cost of a line's strings).
            self.record_quoted(field, value);
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        match value.source() {
            Some(source) => self.record_debug(
                field,
                &format_args!(
                    "{} {}.sources={}",
                    Escaped(value),
                    field.name(),
                    Sources(source)
                ),
            ),
            None => self.record_debug(field, &format_args!("{}", Escaped(value))),
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.result.is_err() {
            return;
        }
        let name = field.name();
        // The `log` bridge's metadata, already in the line's prefix.
        if name.starts_with("log.") {
            return;
        }
        self.separate();
        if self.result.is_err() {
            return;
        }
        self.result = match name {
            "message" => write!(Sanitized(&mut self.writer), "{value:?}"),
            name => {
                let name = name.strip_prefix("r#").unwrap_or(name);
                write!(self.writer, "{name}={value:?}")
            }
        };
    }
}

impl VisitOutput<fmt::Result> for PlainVisitor<'_> {
    fn finish(self) -> fmt::Result {
        self.result
    }
}

impl VisitFmt for PlainVisitor<'_> {
    fn writer(&mut self) -> &mut dyn fmt::Write {
        &mut self.writer
    }
}

/// `T` displayed through [`Sanitized`].
struct Escaped<T>(T);

impl<T: fmt::Display> fmt::Display for Escaped<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(Sanitized(f), "{}", self.0)
    }
}

/// An error's sources, as the default lists them: `["a", "b"]`, escaped.
struct Sources<'e>(&'e (dyn std::error::Error + 'static));

impl fmt::Display for Sources<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        let mut next = Some(self.0);
        while let Some(error) = next {
            list.entry(&format_args!("{}", Escaped(error)));
            next = error.source();
        }
        list.finish()
    }
}

/// Writes through, escaping what a terminal would act on (as the default's
/// message escaping: ESC, BEL, BS, FF, DEL and the C1 controls), whole runs
/// of plain text at a time.
struct Sanitized<W>(W);

impl<W: fmt::Write> fmt::Write for Sanitized<W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut plain = 0;
        for (at, ch) in s.char_indices() {
            let escaped = match ch {
                '\x1b' | '\x07' | '\x08' | '\x0c' | '\x7f' | '\u{80}'..='\u{9f}' => ch as u32,
                _ => continue,
            };
            self.0.write_str(&s[plain..at])?;
            if escaped < 0x80 {
                write!(self.0, "\\x{escaped:02x}")?;
            } else {
                write!(self.0, "\\u{{{escaped:x}}}")?;
            }
            plain = at + ch.len_utf8();
        }
        self.0.write_str(&s[plain..])
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io,
        sync::{Arc, Mutex},
    };

    use tracing_subscriber::{fmt::MakeWriter, layer::SubscriberExt as _};

    use super::*;

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Buffer {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buffer {
        type Writer = Buffer;
        fn make_writer(&'a self) -> Buffer {
            self.clone()
        }
    }

    impl Buffer {
        fn text(&self) -> String {
            String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
        }
    }

    fn events() {
        let addr: std::net::SocketAddr = "198.18.0.1:15008".parse().unwrap();
        let error = io::Error::other("refused \x1b[31mred");
        let span = tracing::info_span!("outbound", pod = "ns/p", src = %addr);
        let _entered = span.enter();
        tracing::info!(
            target: "shunt::access",
            direction = "outbound",
            src.addr = %addr,
            src.identity = "spiffe://td/ns/a \"quoted\"",
            bytes_sent = 7u64,
            ok = true,
            r#type = "x",
            src.workload = "caf\u{e9}\there",
            reason = "",
            "connection complete"
        );
        tracing::warn!(error = %error, "dial {} failed: \x1b[2J \u{9b}", addr);
        tracing::info!(error = &error as &dyn std::error::Error, "as an error");
        let nested = io::Error::other(Nested(io::Error::other("inner \x07")));
        tracing::info!(error = &nested as &dyn std::error::Error, "with sources");
        tracing::info!("only a message");
        tracing::info!(empty = "", "");
    }

    #[derive(Debug)]
    struct Nested(io::Error);

    impl fmt::Display for Nested {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("outer \x1b")
        }
    }

    impl std::error::Error for Nested {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    fn logged(plain: bool) -> String {
        let out = Buffer::default();
        let layer = tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .without_time()
            .with_writer(out.clone());
        let dispatch = if plain {
            tracing::Dispatch::new(
                tracing_subscriber::registry().with(layer.fmt_fields(PlainFields)),
            )
        } else {
            tracing::Dispatch::new(tracing_subscriber::registry().with(layer))
        };
        tracing::dispatcher::with_default(&dispatch, events);
        out.text()
    }

    #[test]
    fn lines_are_the_default_formatters_without_colours() {
        let default = logged(false);
        let plain = logged(true);
        assert_eq!(default.lines().count(), 6, "{default}");
        assert!(default.contains(".sources=["), "{default}");
        assert!(default.contains("\\x1b[2J \\u{9b}"), "{default}");
        assert_eq!(plain, default);
    }
}
