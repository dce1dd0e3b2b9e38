//! kvtier's warnings into Python's `logging`.
//!
//! kvtier reports trouble with `tracing` (a tier job failing, a transfer failing, a store
//! refused). Threads that are not Python's (the tiers' IO threads, copy threads) must not
//! call into Python, so a subscriber keeps each warning or error in a bounded buffer, and the
//! Python-facing calls that run every step hand them to the `kvtier` logger.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::{Mutex, PoisonError};

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

/// At most this many warnings wait for Python; beyond, the oldest are dropped and counted.
const KEPT: usize = 256;

struct Buffer {
    lines: VecDeque<(Level, String)>,
    dropped: u64,
}

static BUFFER: Mutex<Buffer> = Mutex::new(Buffer {
    lines: VecDeque::new(),
    dropped: 0,
});

/// Keeps WARN and ERROR events as text.
struct Keep;

struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}

impl<S: Subscriber> Layer<S> for Keep {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let level = *event.metadata().level();
        if level > Level::WARN {
            return;
        }
        let mut text = Text(format!("{}: ", event.metadata().target()));
        event.record(&mut text);
        let mut b = BUFFER.lock().unwrap_or_else(PoisonError::into_inner);
        if b.lines.len() == KEPT {
            b.lines.pop_front();
            b.dropped += 1;
        }
        b.lines.push_back((level, text.0));
    }
}

/// Installs the subscriber, unless the process has one already.
pub(crate) fn install() {
    let _ = tracing_subscriber::registry().with(Keep).try_init();
}

/// Hands the kept warnings to the `kvtier` logger.
pub(crate) fn flush(py: Python<'_>) -> PyResult<()> {
    let (lines, dropped) = {
        let mut b = BUFFER.lock().unwrap_or_else(PoisonError::into_inner);
        if b.lines.is_empty() && b.dropped == 0 {
            return Ok(());
        }
        (std::mem::take(&mut b.lines), std::mem::take(&mut b.dropped))
    };
    let logger = py
        .import("logging")?
        .call_method1("getLogger", ("kvtier",))?;
    for (level, line) in lines {
        let method = if level == Level::ERROR {
            "error"
        } else {
            "warning"
        };
        logger.call_method1(method, (line,))?;
    }
    if dropped > 0 {
        logger.call_method1(
            "warning",
            (format!("{dropped} more kvtier warnings were dropped"),),
        )?;
    }
    Ok(())
}
