//! The log's writer: lines go into a bounded in-memory buffer and one
//! thread writes the buffer out in batches, so that no proxy task pays a
//! `write(2)` per access line (one line per connection or stream).
//!
//! - Bounded: a line that does not fit is dropped and counted
//!   ([`Batched::dropped`], `shunt_log_lines_dropped_total`); the data path
//!   never waits for the output (a stalled stderr pipe stalls only the
//!   writer thread).
//! - Prompt: the writer sleeps while the buffer is empty, and writes at
//!   most the batch interval (`--log-batch-interval-ms`) after a line
//!   arrives (sooner past [`WRITE_AT`] bytes).
//! - Causal for observers: [`Batched::flush`] has the thread write what is
//!   buffered now and waits for it (bounded by [`FLUSH_WAIT`]); the
//!   agent's admin, metrics and readiness endpoints call it before their
//!   answer leaves, so whatever they show (a connection counted) is
//!   already in the log.
//! - Complete at exit: dropping the [`Guard`] writes everything buffered
//!   and stops the thread; a panic writes the buffer before its message.

use std::{
    io::Write,
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

/// A batch this large is written without waiting for the interval.
pub(crate) const WRITE_AT: usize = 64 * 1024;
/// The buffer's bound: about 10,000 access lines.
pub(crate) const CAPACITY: usize = 4 * 1024 * 1024;
/// The longest a flush waits for the thread (a stalled stderr must not
/// stall whoever asked).
pub(crate) const FLUSH_WAIT: Duration = Duration::from_secs(1);

/// A batching writer over `W` (stderr in the agent). Cheap to clone.
pub(crate) struct Batched<W: Write + Send + 'static> {
    shared: Arc<Shared<W>>,
}

impl<W: Write + Send + 'static> Clone for Batched<W> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

struct Shared<W> {
    pending: Mutex<Pending>,
    /// Wakes the writer thread: a first line, a full batch, a flush, or
    /// closing.
    wake: Condvar,
    /// The output: the thread's while it runs; after closing, whoever
    /// logs writes directly.
    out: Mutex<W>,
    /// The last flush request the thread has written out, and its signal.
    flushed: Mutex<u64>,
    flushed_signal: Condvar,
    dropped: AtomicU64,
    capacity: usize,
    /// How long a line may wait for others to join its batch.
    interval: Duration,
}

struct Pending {
    buf: Vec<u8>,
    /// Flush requests so far (the thread serves them in order).
    flushes: u64,
    /// Set once by the guard: lines from then on are written directly.
    closed: bool,
}

/// Stops the writer thread when dropped, after writing what is buffered.
pub(crate) struct Guard<W: Write + Send + 'static> {
    writer: Batched<W>,
    thread: Option<JoinHandle<()>>,
}

impl<W: Write + Send + 'static> Batched<W> {
    /// The writer over `out`, bounded to `capacity` buffered bytes, and the
    /// guard that owns its thread.
    pub(crate) fn start(
        out: W,
        capacity: usize,
        interval: Duration,
    ) -> std::io::Result<(Self, Guard<W>)> {
        let writer = Self {
            shared: Arc::new(Shared {
                pending: Mutex::new(Pending {
                    buf: Vec::new(),
                    flushes: 0,
                    closed: false,
                }),
                wake: Condvar::new(),
                out: Mutex::new(out),
                flushed: Mutex::new(0),
                flushed_signal: Condvar::new(),
                dropped: AtomicU64::new(0),
                capacity,
                interval,
            }),
        };
        let thread_writer = writer.clone();
        let thread = std::thread::Builder::new()
            .name("shunt-log".into())
            .spawn(move || thread_writer.run())?;
        Ok((
            writer.clone(),
            Guard {
                writer,
                thread: Some(thread),
            },
        ))
    }

    /// Lines dropped because the buffer was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// Has everything buffered now written, and waits for it (at most
    /// [`FLUSH_WAIT`]).
    pub(crate) fn flush(&self) {
        let shared = &*self.shared;
        let mut pending = lock(&shared.pending);
        if pending.closed {
            // No thread any more: write here.
            let batch = std::mem::take(&mut pending.buf);
            drop(pending);
            write_batch(&mut *lock(&shared.out), &batch);
            return;
        }
        pending.flushes += 1;
        let ticket = pending.flushes;
        drop(pending);
        shared.wake.notify_one();
        let deadline = Instant::now() + FLUSH_WAIT;
        let mut flushed = lock(&shared.flushed);
        while *flushed < ticket {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return;
            };
            flushed = shared
                .flushed_signal
                .wait_timeout(flushed, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Buffers one formatted line (the fmt layer writes each event once).
    fn push(&self, line: &[u8]) {
        let mut pending = lock(&self.shared.pending);
        if pending.closed {
            drop(pending);
            write_batch(&mut *lock(&self.shared.out), line);
            return;
        }
        let before = pending.buf.len();
        if before + line.len() > self.shared.capacity {
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        pending.buf.extend_from_slice(line);
        // Only the transitions the writer waits for: the first line of a
        // batch, and the batch growing past WRITE_AT.
        if before == 0 || (before < WRITE_AT && pending.buf.len() >= WRITE_AT) {
            self.shared.wake.notify_one();
        }
    }

    /// The writer thread: sleeps while nothing is buffered, lets a batch
    /// gather for up to the interval (unless a flush asks), writes it;
    /// until closed.
    fn run(&self) {
        let shared = &*self.shared;
        let mut spare = Vec::new();
        let mut served = 0;
        loop {
            let mut pending = lock(&shared.pending);
            let idle = |p: &Pending| !p.closed && p.flushes == served;
            while pending.buf.is_empty() && idle(&pending) {
                pending = shared.wake.wait(pending).unwrap_or_else(|p| p.into_inner());
            }
            let deadline = Instant::now() + shared.interval;
            while pending.buf.len() < WRITE_AT && idle(&pending) {
                let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                    break;
                };
                pending = shared
                    .wake
                    .wait_timeout(pending, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            let closed = pending.closed;
            served = pending.flushes;
            std::mem::swap(&mut pending.buf, &mut spare);
            // The output before letting go of the buffer: once closed,
            // direct writes queue behind this last batch (lock order:
            // pending, then out, everywhere).
            let mut out = lock(&shared.out);
            drop(pending);
            write_batch(&mut *out, &spare);
            drop(out);
            *lock(&shared.flushed) = served;
            shared.flushed_signal.notify_all();
            spare.clear();
            // A batch that grew large leaves no large buffer behind.
            if spare.capacity() > 2 * WRITE_AT {
                spare = Vec::new();
            }
            if closed {
                return;
            }
        }
    }
}

impl<W: Write + Send + 'static> Drop for Guard<W> {
    fn drop(&mut self) {
        lock(&self.writer.shared.pending).closed = true;
        self.writer.shared.wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // Anything pushed between the thread's last batch and `closed`
        // (or everything, if the thread is stuck on a stalled output).
        self.writer.flush();
    }
}

/// One `write` per batch; an output error loses the batch (there is
/// nowhere left to report it).
fn write_batch<W: Write>(out: &mut W, batch: &[u8]) {
    if batch.is_empty() {
        return;
    }
    let _ = out.write_all(batch);
    let _ = out.flush();
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the fmt layer writes one event through.
pub(crate) struct Line<'a, W: Write + Send + 'static>(&'a Batched<W>);

impl<W: Write + Send + 'static> Write for Line<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.push(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a, W: Write + Send + 'static> tracing_subscriber::fmt::MakeWriter<'a> for Batched<W> {
    type Writer = Line<'a, W>;

    fn make_writer(&'a self) -> Self::Writer {
        Line(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Longer than any test: only flushes and the guard write.
    const LONG: Duration = Duration::from_secs(600);

    /// An output the test can read while the writer holds it.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            lock(&self.0).extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Sink {
        fn text(&self) -> String {
            String::from_utf8(lock(&self.0).clone()).expect("utf-8")
        }
    }

    fn write_line<W: Write + Send + 'static>(writer: &Batched<W>, line: &str) {
        use tracing_subscriber::fmt::MakeWriter;
        writer
            .make_writer()
            .write_all(line.as_bytes())
            .expect("buffered");
    }

    #[test]
    fn lines_buffered_at_exit_are_written_when_the_guard_drops() {
        let sink = Sink::default();
        let (writer, guard) = Batched::start(sink.clone(), CAPACITY, LONG).expect("thread");
        for i in 0..100 {
            write_line(&writer, &format!("line {i}\n"));
        }
        drop(guard);
        let text = sink.text();
        let want: String = (0..100).map(|i| format!("line {i}\n")).collect();
        assert_eq!(text, want, "every line, in order");
        // After the guard, lines go straight to the output.
        write_line(&writer, "late\n");
        assert!(sink.text().ends_with("late\n"));
    }

    #[test]
    fn flush_writes_what_is_buffered_now() {
        let sink = Sink::default();
        let (writer, _guard) = Batched::start(sink.clone(), CAPACITY, LONG).expect("thread");
        write_line(&writer, "connection complete\n");
        writer.flush();
        assert_eq!(sink.text(), "connection complete\n");
    }

    #[test]
    fn a_full_buffer_drops_and_counts_lines_instead_of_waiting() {
        /// An output that blocks until released: a stalled stderr pipe.
        struct Stalled(Arc<(Mutex<bool>, Condvar)>, Sink);
        impl Write for Stalled {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                let (open, cv) = &*self.0;
                let mut open = lock(open);
                while !*open {
                    open = cv.wait(open).unwrap_or_else(|p| p.into_inner());
                }
                self.1.write(buf)
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let sink = Sink::default();
        let (writer, guard) =
            Batched::start(Stalled(gate.clone(), sink.clone()), 100, LONG).expect("thread");
        // 10 lines of 30 bytes into 100 bytes: the writer thread may have
        // taken the first batch (and stalls on it); the rest fill up.
        for i in 0..10 {
            write_line(&writer, &format!("{i:028}\n"));
        }
        assert!(
            writer.dropped() >= 10 - 3 - 3,
            "dropped {} of 10 lines",
            writer.dropped()
        );
        let (open, cv) = &*gate;
        *lock(open) = true;
        cv.notify_all();
        drop(guard);
        let written = sink.text().lines().count() as u64;
        assert_eq!(written + writer.dropped(), 10, "{}", sink.text());
    }
}
