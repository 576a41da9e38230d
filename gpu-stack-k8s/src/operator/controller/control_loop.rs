//! The loop style of the operator's controllers that are not per-object
//! (the driver upgrade loop and the MIG demand loop): triggers gathered into
//! one pass, a pass at a time, the next one when the pass asks or a trigger
//! comes, failures retried with [`Backoff`], each pass in a span and marked
//! in [`Progress`] (so `/healthz` sees a wedged one), and a stop on shutdown
//! between passes (every API call a pass makes has its own deadline, so a
//! pass in flight ends soon). Leadership reaches a loop as its shutdown: the
//! runner stops every loop when the lease is lost, and the client's write
//! gate refuses writes before that.
//!
//! The ClusterPolicy loop is per object (finalizers, a policy deleted or
//! taking over) and runs on kube-runtime's `Controller`, with the same
//! backoff, progress marks and span.
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::Instrument;

use super::Backoff;
use super::ops::Progress;

/// How triggers are gathered into one pass: it runs once `quiet` has passed
/// without a trigger, and at the latest `at_most` after the first one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batching {
    /// Quiet period after a trigger.
    pub quiet: Duration,
    /// The longest a trigger waits for its pass.
    pub at_most: Duration,
}

impl Batching {
    /// When a pass is due after a trigger at `now`, the first of the batch
    /// having come at `first`.
    pub fn due(self, first: Instant, now: Instant) -> Instant {
        (now + self.quiet).min(first + self.at_most.max(self.quiet))
    }
}

/// One controller's pass.
pub trait LoopPass: Send {
    /// Why a pass failed.
    type Error: std::fmt::Display + Send;

    /// Runs one pass; on success, how long until the next one unless a
    /// trigger comes first.
    fn run(&mut self) -> impl Future<Output = Result<Duration, Self::Error>> + Send;

    /// How triggers are gathered now (it may follow what the pass reads).
    fn batching(&self) -> Batching;
}

/// Runs `pass` (first at once) until `shutdown` resolves; every item of
/// `triggers` asks for a pass. `name` names the loop in logs, spans and
/// `/healthz`.
pub async fn run_loop<P: LoopPass>(
    name: &'static str,
    mut pass: P,
    triggers: impl Stream<Item = ()> + Send + 'static,
    progress: Progress,
    shutdown: impl Future<Output = ()> + Send,
) {
    // The triggers' stream is polled by a task of its own, whatever the
    // loop does (the watches behind it feed the caches a pass reads only
    // while polled); one stored wake-up stands for a whole burst.
    let wake = Arc::new(Notify::new());
    let feeder = tokio::spawn({
        let wake = wake.clone();
        async move {
            tokio::pin!(triggers);
            while triggers.next().await.is_some() {
                wake.notify_one();
            }
        }
    });
    tokio::pin!(shutdown);
    let mut backoff = Backoff::new();
    let mut timer = Instant::now();
    let mut batch: Option<(Instant, Instant)> = None;
    loop {
        let due = batch.map_or(timer, |(_, at)| at.min(timer));
        tokio::select! {
            () = &mut shutdown => break,
            () = wake.notified() => {
                let now = Instant::now();
                let first = batch.map_or(now, |(first, _)| first);
                batch = Some((first, pass.batching().due(first, now)));
                continue;
            }
            () = tokio::time::sleep_until(due) => {}
        }
        batch = None;
        let in_flight = progress.begin(name);
        let outcome = pass
            .run()
            .instrument(tracing::info_span!("loop", name))
            .await;
        drop(in_flight);
        let next = match outcome {
            Ok(next) => {
                backoff.reset();
                next
            }
            Err(error) => {
                let retry_in = backoff.fail();
                tracing::warn!(name, %error, ?retry_in, "pass failed; retrying");
                retry_in
            }
        };
        timer = Instant::now() + next;
    }
    feeder.abort();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records when each pass ran; fails the passes listed in `fail`.
    struct Recorder {
        runs: Arc<Mutex<Vec<Instant>>>,
        fail: Vec<usize>,
        next: Duration,
    }

    impl LoopPass for Recorder {
        type Error = String;

        async fn run(&mut self) -> Result<Duration, String> {
            let mut runs = self.runs.lock().map_err(|e| e.to_string())?;
            runs.push(Instant::now());
            if self.fail.contains(&runs.len()) {
                return Err("boom".into());
            }
            Ok(self.next)
        }

        fn batching(&self) -> Batching {
            Batching {
                quiet: Duration::from_secs(1),
                at_most: Duration::from_secs(4),
            }
        }
    }

    #[test]
    fn a_batch_waits_for_quiet_but_never_past_its_cap() {
        let b = Batching {
            quiet: Duration::from_secs(1),
            at_most: Duration::from_secs(4),
        };
        let t0 = Instant::now();
        assert_eq!(b.due(t0, t0), t0 + Duration::from_secs(1));
        assert_eq!(
            b.due(t0, t0 + Duration::from_millis(2500)),
            t0 + Duration::from_millis(3500)
        );
        assert_eq!(
            b.due(t0, t0 + Duration::from_secs(10)),
            t0 + Duration::from_secs(4)
        );
        // A cap shorter than the quiet period is the quiet period.
        let fixed = Batching {
            quiet: Duration::from_secs(1),
            at_most: Duration::ZERO,
        };
        assert_eq!(fixed.due(t0, t0), t0 + Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn passes_follow_the_timer_triggers_and_backoff_and_stop_on_shutdown() {
        let runs = Arc::new(Mutex::new(Vec::new()));
        let pass = Recorder {
            runs: runs.clone(),
            fail: vec![2, 3],
            next: Duration::from_secs(60),
        };
        let (trigger_tx, trigger_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        let triggers = futures::stream::unfold(trigger_rx, |mut rx| async move {
            rx.recv().await.map(|t| (t, rx))
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let progress = Progress::default();
        let start = Instant::now();
        let task = tokio::spawn(run_loop("test", pass, triggers, progress.clone(), async {
            let _ = stop_rx.await;
        }));
        let at = |i: usize| runs.lock().unwrap().get(i).map(|t| *t - start);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(at(0), Some(Duration::ZERO), "the first pass runs at once");
        // A burst of triggers: one pass, a quiet second after the last.
        for _ in 0..3 {
            trigger_tx.send(()).unwrap();
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let second = at(1).expect("a pass after the burst");
        assert_eq!(
            runs.lock().unwrap().len(),
            4,
            "one pass for the burst, then two retries"
        );
        assert!(second >= Duration::from_millis(2000), "{second:?}");
        // Failed passes 2 and 3 retried after 100 ms, then 200 ms.
        assert_eq!(at(2).unwrap() - second, Duration::from_millis(100));
        assert_eq!(at(3).unwrap() - at(2).unwrap(), Duration::from_millis(200));
        // Then the pass's own timer: the next pass 60 s after the last.
        tokio::time::sleep(Duration::from_secs(58)).await;
        assert_eq!(runs.lock().unwrap().len(), 4);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(at(4).unwrap() - at(3).unwrap(), Duration::from_secs(60));
        stop_tx.send(()).unwrap();
        task.await.unwrap();
        assert!(
            progress
                .wedged(Instant::now() + Duration::from_secs(3600))
                .is_empty()
        );
    }
}
