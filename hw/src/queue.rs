//! The one concurrent structure of kvtier-hw: a closable multi-producer, multi-consumer FIFO.
//!
//! It carries work from the driver to IO threads and completions from IO threads back to the
//! driver. The driver thread alone owns the core; everything that crosses threads crosses
//! here, and `hw/tests/loom.rs` (with the `loom` feature) checks it under every interleaving.
//!
//! Guarantees, each checked by loom:
//! - Q1: every pushed item is popped exactly once, in push order.
//! - Q2: a blocked `pop` wakes when an item arrives or the queue closes (no lost wakeup).
//! - Q3: after `close`, pushes are refused (the item is handed back), and pops drain what is
//!   left, then answer `None`.
//! - Q4: an urgent item is popped before every ordinary item still queued; each class is FIFO.
//! - Q5 ([`Countdown`]): when the parts of one job end on several threads, exactly one of
//!   them, the last, receives every part's outcome.
//! - Q6: `take_ordinary` takes ordinary items only while no urgent item waits, so taking a
//!   batch of cascades never delays a promotion queued before the batch was taken.
//!   (A tier serves promotions, which a request waits for, before cascades, which nobody
//!   waits for.)

use std::collections::VecDeque;

use crate::sync::{Condvar, Mutex, lock};

struct State<T> {
    urgent: VecDeque<T>,
    items: VecDeque<T>,
    closed: bool,
}

impl<T> State<T> {
    fn pop(&mut self) -> Option<T> {
        self.urgent.pop_front().or_else(|| self.items.pop_front())
    }
}

/// A closable FIFO shared between threads (wrap it in an `Arc`).
pub struct Queue<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Queue<T> {
    /// An empty, open queue.
    pub fn new() -> Self {
        Queue {
            state: Mutex::new(State {
                urgent: VecDeque::new(),
                items: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
        }
    }

    /// Q1, Q3: appends `item`, or hands it back if the queue is closed.
    pub fn push(&self, item: T) -> Result<(), T> {
        self.push_to(item, false)
    }

    /// Q4: appends `item` ahead of every ordinary item, or hands it back if closed.
    pub fn push_urgent(&self, item: T) -> Result<(), T> {
        self.push_to(item, true)
    }

    fn push_to(&self, item: T, urgent: bool) -> Result<(), T> {
        let mut s = lock(&self.state);
        if s.closed {
            return Err(item);
        }
        if urgent {
            s.urgent.push_back(item);
        } else {
            s.items.push_back(item);
        }
        drop(s);
        self.ready.notify_one();
        Ok(())
    }

    /// Q2, Q3: the oldest item, waiting for one; `None` once the queue is closed and empty.
    pub fn pop(&self) -> Option<T> {
        let mut s = lock(&self.state);
        loop {
            if let Some(item) = s.pop() {
                return Some(item);
            }
            if s.closed {
                return None;
            }
            s = self.ready.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Waits up to `timeout` until an item is queued, without taking it: whether one is (or
    /// the queue is closed). For a consumer that takes items under a lock of its own and
    /// waits with that lock released.
    pub fn wait_for_item(&self, timeout: std::time::Duration) -> bool {
        let Some(deadline) = std::time::Instant::now().checked_add(timeout) else {
            let mut s = lock(&self.state);
            while s.urgent.is_empty() && s.items.is_empty() && !s.closed {
                s = self.ready.wait(s).unwrap_or_else(|e| e.into_inner());
            }
            return true;
        };
        let mut s = lock(&self.state);
        loop {
            if !s.urgent.is_empty() || !s.items.is_empty() || s.closed {
                return true;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return false;
            }
            s = self
                .ready
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Moves every item now queued into `out`, without waiting. Returns how many.
    pub fn drain_into(&self, out: &mut Vec<T>) -> usize {
        let mut s = lock(&self.state);
        let n = s.urgent.len() + s.items.len();
        let s = &mut *s;
        out.extend(s.urgent.drain(..).chain(s.items.drain(..)));
        n
    }

    /// Q6: moves up to `max` ordinary items now queued into `out`, without waiting, and only
    /// while no urgent item is queued (urgent items keep going first). Returns how many.
    pub fn take_ordinary(&self, max: usize, out: &mut Vec<T>) -> usize {
        let mut s = lock(&self.state);
        if !s.urgent.is_empty() {
            return 0;
        }
        let n = max.min(s.items.len());
        out.extend(s.items.drain(..n));
        n
    }

    /// Q3: refuses further pushes and wakes every waiter.
    pub fn close(&self) {
        lock(&self.state).closed = true;
        self.ready.notify_all();
    }

    /// Whether `close` was called.
    pub fn is_closed(&self) -> bool {
        lock(&self.state).closed
    }

    /// Like [`pop`](Self::pop), but gives up after `timeout` (answering `None`).
    pub fn pop_timeout(&self, timeout: std::time::Duration) -> Option<T> {
        // A timeout too long to add to the clock waits as `pop` does.
        let Some(deadline) = std::time::Instant::now().checked_add(timeout) else {
            return self.pop();
        };
        let mut s = lock(&self.state);
        loop {
            if let Some(item) = s.pop() {
                return Some(item);
            }
            let now = std::time::Instant::now();
            if s.closed || now >= deadline {
                return None;
            }
            s = self
                .ready
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// Counts down the parts of one job that run on several threads (rule Q5).
pub struct Countdown<T> {
    state: Mutex<(usize, Vec<T>)>,
}

impl<T> Countdown<T> {
    /// A job of `parts` parts (at least one).
    pub fn new(parts: usize) -> Self {
        Countdown {
            state: Mutex::new((parts.max(1), Vec::with_capacity(parts))),
        }
    }

    /// Records one part's outcome; the last part gets every outcome back, the others `None`.
    pub fn finish(&self, outcome: T) -> Option<Vec<T>> {
        let mut s = lock(&self.state);
        s.1.push(outcome);
        s.0 -= 1;
        (s.0 == 0).then(|| std::mem::take(&mut s.1))
    }
}

#[cfg(all(test, not(feature = "loom")))]
mod tests {
    use super::Queue;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn wait_for_item_ends_at_its_timeout_and_takes_nothing() {
        let q: Arc<Queue<u32>> = Arc::new(Queue::new());
        let start = Instant::now();
        assert!(!q.wait_for_item(Duration::from_millis(20)));
        assert!(start.elapsed() >= Duration::from_millis(20));
        let pusher = {
            let q = q.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(10));
                q.push(7).unwrap();
            })
        };
        assert!(q.wait_for_item(Duration::from_secs(10)));
        pusher.join().unwrap();
        // The item is still there for the consumer.
        assert_eq!(q.pop_timeout(Duration::ZERO), Some(7));
        q.close();
        assert!(
            q.wait_for_item(Duration::from_secs(10)),
            "a closed queue ends the wait"
        );
    }
}
