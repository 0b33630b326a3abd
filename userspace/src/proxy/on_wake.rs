//! A future polled only when its own waker fired, for the rare branches of
//! a `select!` in a task that is woken for something else nearly every
//! time: beside an HBONE connection's frames or a relay's bytes, its
//! keepalive timer, the drain and abort signals and the policy watch.
//! `select!` polls every branch on every wake-up, and a timer's or a
//! `CancellationToken`'s poll (a lock, a waker comparison) costs a few
//! hundred instructions, paid per transaction for nothing
//! (docs/BENCHMARKS.md, issue 35).
//!
//! [`OnWake`] gives the inner future a waker of its own, which marks it
//! woken and wakes the task; a poll of the task polls the inner future only
//! when it is so marked (and the first time). While it is not, and the task
//! is the one it last registered, a poll is a plain load and a pointer
//! comparison: no locked instruction, as a register or a swap would be
//! (three per poll, and such branches are polled ≈ 18 times per proxied
//! request/response across the two agents).

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll, Wake, Waker},
};

use futures::task::AtomicWaker;

pin_project_lite::pin_project! {
    /// `future`, polled only after it woke its task (see the module
    /// comment). Pin it (`tokio::pin!`) to keep it across `select!` loops.
    pub(crate) struct OnWake<F> {
        #[pin]
        future: F,
        signal: Arc<Signal>,
        // The inner future's waker: `signal`'s.
        waker: Waker,
        // The task's waker as last registered with `signal.task`.
        registered: Option<Waker>,
    }
}

/// Whether the inner future woke since its last poll, and the task to wake.
struct Signal {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl<F: Future> OnWake<F> {
    pub fn new(future: F) -> Self {
        let signal = Arc::new(Signal {
            // Polled the first time: that registers its waker.
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        Self {
            future,
            waker: Waker::from(Arc::clone(&signal)),
            signal,
            registered: None,
        }
    }
}

impl<F: Future> Future for OnWake<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let same_task = this
            .registered
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()));
        // Not woken: `signal.task` still holds this task's waker, since only
        // a wake-up takes it, and a wake-up marks `woken` first. One whose
        // mark this load misses has woken the task already: it is polled
        // again, and then sees the mark.
        if same_task && !this.signal.woken.load(Ordering::Acquire) {
            return Poll::Pending;
        }
        // The task's waker first: a wake-up between here and the inner
        // poll then wakes the task again rather than getting lost.
        this.signal.task.register(cx.waker());
        if !same_task {
            *this.registered = Some(cx.waker().clone());
        }
        if !this.signal.woken.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        this.future.poll(&mut Context::from_waker(this.waker))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// Counts its polls; ready once `open` is set (and then woken).
    struct Gate {
        polls: Arc<AtomicUsize>,
        open: Arc<AtomicBool>,
        waker: Arc<std::sync::Mutex<Option<Waker>>>,
    }

    impl Future for Gate {
        type Output = ();
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, Ordering::SeqCst);
            if self.open.load(Ordering::SeqCst) {
                return Poll::Ready(());
            }
            *self.waker.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
            Poll::Pending
        }
    }

    #[test]
    fn the_inner_future_is_polled_first_and_then_only_when_it_woke() {
        let polls = Arc::new(AtomicUsize::new(0));
        let open = Arc::new(AtomicBool::new(false));
        let inner_waker = Arc::new(std::sync::Mutex::new(None::<Waker>));
        let mut gated = OnWake::new(Gate {
            polls: polls.clone(),
            open: open.clone(),
            waker: inner_waker.clone(),
        });
        let task_woken = Arc::new(Counter::default());
        let task_waker = Waker::from(task_woken.clone());
        let mut cx = Context::from_waker(&task_waker);

        assert!(Pin::new(&mut gated).poll(&mut cx).is_pending());
        assert_eq!(polls.load(Ordering::SeqCst), 1, "the first poll reaches it");
        // The task woken for something else: the inner future is left alone.
        for _ in 0..5 {
            assert!(Pin::new(&mut gated).poll(&mut cx).is_pending());
        }
        assert_eq!(
            polls.load(Ordering::SeqCst),
            1,
            "not polled without its own wake-up"
        );

        open.store(true, Ordering::SeqCst);
        wake_inner(&inner_waker);
        assert_eq!(
            task_woken.0.load(Ordering::SeqCst),
            1,
            "its wake-up wakes the task"
        );
        assert!(Pin::new(&mut gated).poll(&mut cx).is_ready());
        assert_eq!(polls.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn every_wake_up_reaches_the_task_after_one_was_taken() {
        let polls = Arc::new(AtomicUsize::new(0));
        let inner_waker = Arc::new(std::sync::Mutex::new(None::<Waker>));
        let mut gated = OnWake::new(Gate {
            polls: polls.clone(),
            open: Arc::new(AtomicBool::new(false)),
            waker: inner_waker.clone(),
        });
        let task_woken = Arc::new(Counter::default());
        let task_waker = Waker::from(task_woken.clone());
        let mut cx = Context::from_waker(&task_waker);
        assert!(Pin::new(&mut gated).poll(&mut cx).is_pending());
        for round in 1..=3 {
            // A wake-up takes the task's waker: the next poll registers it
            // again, or the round after would wake nothing.
            wake_inner(&inner_waker);
            assert_eq!(task_woken.0.load(Ordering::SeqCst), round);
            assert!(Pin::new(&mut gated).poll(&mut cx).is_pending());
            assert_eq!(polls.load(Ordering::SeqCst), round + 1, "woken: polled");
            assert!(Pin::new(&mut gated).poll(&mut cx).is_pending());
            assert_eq!(polls.load(Ordering::SeqCst), round + 1, "not woken: not");
        }
        // Polled by another task: its waker is the one registered.
        let other = Arc::new(Counter::default());
        let other_waker = Waker::from(other.clone());
        assert!(
            Pin::new(&mut gated)
                .poll(&mut Context::from_waker(&other_waker))
                .is_pending()
        );
        wake_inner(&inner_waker);
        assert_eq!(other.0.load(Ordering::SeqCst), 1, "the new task is woken");
        assert_eq!(task_woken.0.load(Ordering::SeqCst), 3);
    }

    /// Wakes the waker the inner future last registered.
    fn wake_inner(slot: &std::sync::Mutex<Option<Waker>>) {
        slot.lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .expect("the inner future registered a waker")
            .wake();
    }

    #[derive(Default)]
    struct Counter(AtomicUsize);

    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}
