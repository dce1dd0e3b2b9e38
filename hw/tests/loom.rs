//! loom checks of the queue between the driver and the IO threads (rules Q1–Q5 in
//! `hw/src/queue.rs`), under every interleaving loom explores. Run with:
//!
//! ```sh
//! LOOM_MAX_PREEMPTIONS=3 cargo test -p kvtier-hw --features loom --test loom --release
//! ```
#![cfg(feature = "loom")]

use kvtier_hw::Queue;
use loom::sync::Arc;
use loom::thread;

/// Q1, Q2: two IO threads each complete a job; the blocked driver receives both, exactly once,
/// each thread's items in order.
#[test]
fn every_completion_arrives_once() {
    loom::model(|| {
        let q = Arc::new(Queue::new());
        let producers: Vec<_> = [0u32, 10]
            .into_iter()
            .map(|base| {
                let q = q.clone();
                thread::spawn(move || {
                    q.push(base).unwrap();
                    q.push(base + 1).unwrap();
                })
            })
            .collect();
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(q.pop().expect("open queue"));
        }
        for p in producers {
            p.join().unwrap();
        }
        let mine = |base: u32| {
            got.iter()
                .copied()
                .filter(|&x| x / 10 == base / 10)
                .collect::<Vec<_>>()
        };
        assert_eq!(mine(0), vec![0, 1]);
        assert_eq!(mine(10), vec![10, 11]);
        let mut rest = Vec::new();
        assert_eq!(q.drain_into(&mut rest), 0);
    });
}

/// Q2, Q3: a consumer blocked on an empty queue wakes when another thread closes it.
#[test]
fn close_wakes_a_blocked_consumer() {
    loom::model(|| {
        let q: Arc<Queue<u32>> = Arc::new(Queue::new());
        let consumer = {
            let q = q.clone();
            thread::spawn(move || {
                let mut seen = Vec::new();
                while let Some(x) = q.pop() {
                    seen.push(x);
                }
                seen
            })
        };
        let pushed = q.push(7).is_ok();
        q.close();
        let seen = consumer.join().unwrap();
        assert!(pushed);
        assert_eq!(
            seen,
            vec![7],
            "an item pushed before close is still delivered"
        );
    });
}

/// Q3: after close a push is refused and handed back; nothing is lost or duplicated between
/// a racing push and close.
#[test]
fn push_racing_close_is_either_delivered_or_refused() {
    loom::model(|| {
        let q: Arc<Queue<u32>> = Arc::new(Queue::new());
        let producer = {
            let q = q.clone();
            thread::spawn(move || q.push(1))
        };
        q.close();
        let pushed = producer.join().unwrap();
        let mut rest = Vec::new();
        q.drain_into(&mut rest);
        match pushed {
            Ok(()) => assert_eq!(rest, vec![1]),
            Err(item) => {
                assert_eq!(item, 1);
                assert!(rest.is_empty());
            }
        }
        assert!(q.push(2).is_err());
        assert_eq!(q.pop(), None);
    });
}

/// Q4: an urgent item (a promotion) overtakes ordinary ones (cascades) still queued, whatever
/// the interleaving of the pushes with a consumer; nothing is lost.
#[test]
fn urgent_items_overtake_ordinary_ones() {
    loom::model(|| {
        let q: Arc<Queue<u32>> = Arc::new(Queue::new());
        let producer = {
            let q = q.clone();
            thread::spawn(move || {
                q.push(1).unwrap();
                q.push(2).unwrap();
                q.push_urgent(10).unwrap();
            })
        };
        let first = q.pop().unwrap();
        producer.join().unwrap();
        let mut rest = Vec::new();
        q.drain_into(&mut rest);
        match first {
            // Popped before the urgent item arrived: the urgent one leads what is left.
            1 => assert_eq!(rest, vec![10, 2]),
            2 => unreachable!("FIFO among ordinary items"),
            _ => assert_eq!((first, rest), (10, vec![1, 2])),
        }
    });
}

/// Q5: two copy threads end the two parts of one job; exactly one of them, the last,
/// receives both outcomes and reports the job.
#[test]
fn the_last_part_reports_the_job_once() {
    use kvtier_hw::Countdown;
    loom::model(|| {
        let job = Arc::new(Countdown::new(2));
        let parts: Vec<_> = [1u32, 2]
            .into_iter()
            .map(|outcome| {
                let job = job.clone();
                thread::spawn(move || job.finish(outcome))
            })
            .collect();
        let reports: Vec<Vec<u32>> = parts
            .into_iter()
            .filter_map(|p| p.join().unwrap())
            .collect();
        assert_eq!(reports.len(), 1, "exactly one report");
        let mut outcomes = reports[0].clone();
        outcomes.sort_unstable();
        assert_eq!(outcomes, vec![1, 2]);
    });
}

/// Q4, Q6: an IO thread that took a cascade and then takes the cascades queued behind it never
/// takes them past a promotion pushed concurrently: whatever it took, the promotion is popped
/// before any cascade left behind, and every item is taken exactly once.
#[test]
fn taking_a_batch_never_passes_an_urgent_item() {
    loom::model(|| {
        let q = Arc::new(Queue::new());
        q.push(1u32).unwrap();
        q.push(2).unwrap();
        q.push(3).unwrap();
        let driver = {
            let q = q.clone();
            thread::spawn(move || q.push_urgent(100).unwrap())
        };
        let first = q.pop().expect("open queue");
        let mut batch = vec![first];
        q.take_ordinary(1, &mut batch);
        driver.join().unwrap();
        let mut rest = Vec::new();
        while let Some(x) = q.pop_timeout(std::time::Duration::ZERO) {
            rest.push(x);
        }
        let mut all: Vec<u32> = batch.iter().chain(&rest).copied().collect();
        all.sort_unstable();
        assert_eq!(all, vec![1, 2, 3, 100]);
        // If the batch took an ordinary item, the urgent one was not queued yet; either way,
        // once queued, it goes before every ordinary item still waiting.
        if let Some(p) = rest.iter().position(|&x| x == 100) {
            assert!(rest[..p].iter().all(|&x| x == 100), "{batch:?} {rest:?}");
        }
    });
}
