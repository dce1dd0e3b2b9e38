//! Group commit: jobs that finish their writes while a sync runs share the next sync instead
//! of issuing one each.
//!
//! A job takes a ticket once its writes completed. A sync (one at a time) covers every ticket
//! taken before it started; when it returns, its outcome is handed to each waiting job it
//! covers that no earlier sync covered. A job with no outcome yet waits while a sync runs,
//! then starts the next one itself if no other job did. So a job is acknowledged only by a
//! sync that started after its writes, and a failed sync fails every job that relied on it,
//! even if a later sync succeeds.

use std::collections::BTreeMap;
use std::io;

use crate::sync::{Condvar, Mutex, lock};

/// The outcome of one sync, as each job it covers sees it.
type Outcome = Result<(), (io::ErrorKind, String)>;

#[derive(Default)]
struct State {
    /// Tickets taken so far (the last one taken).
    taken: u64,
    /// Whether a sync is running.
    running: bool,
    /// The jobs waiting, by ticket, and their outcome once a sync covering them returned.
    waiting: BTreeMap<u64, Option<Outcome>>,
}

/// Shares syncs between concurrent jobs.
pub(crate) struct GroupCommit {
    state: Mutex<State>,
    done: Condvar,
}

impl Default for GroupCommit {
    fn default() -> Self {
        GroupCommit {
            state: Mutex::new(State::default()),
            done: Condvar::new(),
        }
    }
}

impl GroupCommit {
    /// Returns once a call of `sync` (an `fdatasync`) that started after this call was made has
    /// returned, with its outcome: the caller's writes, all completed before the call, are then
    /// durable (or the error says they may not be). One `sync` runs at a time.
    pub(crate) fn sync(&self, sync: &dyn Fn() -> io::Result<()>) -> io::Result<()> {
        let mut st = lock(&self.state);
        st.taken += 1;
        let ticket = st.taken;
        st.waiting.insert(ticket, None);
        loop {
            if let Some(outcome) = st.waiting.get(&ticket).and_then(Option::clone) {
                st.waiting.remove(&ticket);
                return outcome.map_err(|(kind, msg)| io::Error::new(kind, msg));
            }
            if st.running {
                st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            // Start one covering every ticket taken so far.
            st.running = true;
            let upto = st.taken;
            drop(st);
            let result = sync();
            st = lock(&self.state);
            st.running = false;
            let outcome: Outcome = result.map_err(|e| (e.kind(), e.to_string()));
            for (_, o) in st.waiting.range_mut(..=upto) {
                if o.is_none() {
                    *o = Some(outcome.clone());
                }
            }
            self.done.notify_all();
        }
    }
}
