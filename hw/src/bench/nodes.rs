//! `kvtier bench --nodes N`: one workload replayed by N kvtier processes (nodes) that share a
//! tier, as the nodes of an inference fleet share a Redis store.
//!
//! The parent process starts N copies of its own executable, each told its index. Every node
//! reads the same workload and replays only the requests of its conversations
//! ([`conversations`], [`node_share`]), in the workload's order, through its own region,
//! primary and authoritative tiers and the shared tier every node opens with the same
//! namespace and identity. A node writes to the parent on stdout, one JSON object per line:
//! its progress, then its report. The parent adds them up ([`NodesReport`]).
//!
//! Cross-node hits: each node remembers which blocks it wrote to a shared tier ([`Tracked`]);
//! a block it promoted from that tier without having written it there was stored by another
//! node.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvtier_core::{Key, TierKind};
use serde::{Deserialize, Serialize};

use super::run::{Progress, Report};
use super::workload::Request;
use super::{BenchError, fmt_bytes};
use crate::store::{SecondaryStore, StoreError};
use crate::sync::{Mutex, lock};

/// Nodes a run may start at most.
pub const MAX_NODES: u32 = 64;

/// The environment variable through which a node learns its parent's process id: a node
/// ends when that process does (it asks the kernel for a signal at its parent's death).
pub const PARENT_ENV: &str = "KVTIER_BENCH_PARENT";

/// The conversation of each request, numbered in order of first appearance.
///
/// A request continues a conversation when it extends one of the conversation's earlier
/// requests: it starts with every block of that request, or with every block but the last
/// when that last block was partial (the next turn appends to a partial block, so its id
/// changes). Otherwise it starts a new conversation. Block ids are prefix hashes (Mooncake's
/// are; so are the synthetic workload's): the id at a position names the whole prefix up to
/// it, so "starts with" is one lookup of the earlier request's last kept block at its
/// position. Where several earlier requests fit, the longest wins.
///
/// Requests that only share a prefix (a system prompt, a document) without extending each
/// other are different conversations: the blocks they share are what nodes find in each
/// other's stores. (A request's first block would not do as its conversation: every request
/// that shares any block shares the first one, so no node would ever read another's.) The
/// ids cannot tell one case apart: when a request's last full block is one it shares with
/// others (its own words all fit in its partial last block), a later request on that prefix
/// is taken for its next turn.
pub fn conversations(requests: &[Request]) -> Vec<u32> {
    let mut c = Conversations::default();
    requests.iter().map(|r| c.of(r)).collect()
}

/// [`conversations`] one request at a time, in the workload's order: a node reading a
/// trace keeps only its own requests, and what this keeps of the others is one entry each.
#[derive(Default)]
pub struct Conversations {
    /// (position, block id) of each request's last kept block → its conversation.
    ends: HashMap<(usize, u64), u32>,
    next: u32,
}

impl Conversations {
    /// The conversation of `r`, the request after those already given.
    pub fn of(&mut self, r: &Request) -> u32 {
        let found = (0..r.blocks.len())
            .rev()
            .find_map(|p| self.ends.get(&(p, r.blocks[p])).copied());
        let c = found.unwrap_or_else(|| {
            self.next += 1;
            self.next - 1
        });
        let kept = r.whole_len();
        if kept > 0 {
            self.ends.insert((kept - 1, r.blocks[kept - 1]), c);
        }
        c
    }

    /// Whether `r`, the request after those already given, is node `node`'s of `nodes`
    /// (as [`nodes_of`] deals them).
    pub fn is_nodes(&mut self, r: &Request, node: u32, nodes: u32) -> bool {
        self.of(r) % nodes.max(1) == node
    }
}

/// The node (of `nodes`) that replays each request: conversation `c` goes to node
/// `c % nodes`, so conversations are dealt round-robin in order of first appearance.
pub fn nodes_of(requests: &[Request], nodes: u32) -> Vec<u32> {
    let nodes = nodes.max(1);
    conversations(requests)
        .into_iter()
        .map(|c| c % nodes)
        .collect()
}

/// The requests node `node` of `nodes` replays, in the workload's order.
pub fn node_share(requests: &[Request], node: u32, nodes: u32) -> Vec<Request> {
    requests
        .iter()
        .zip(nodes_of(requests, nodes))
        .filter(|&(_, n)| n == node)
        .map(|(r, _)| r.clone())
        .collect()
}

#[derive(Default)]
struct Seen {
    /// Keys this process wrote.
    written: HashSet<Key>,
    /// Keys this process read and never wrote: another process wrote them.
    foreign: HashSet<Key>,
}

/// A shared tier's store that remembers which blocks this process wrote to it, and which it
/// read from it without having written them (blocks another node stored).
pub struct Tracked<S> {
    inner: S,
    seen: Mutex<Seen>,
}

impl<S: SecondaryStore> Tracked<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        Tracked {
            inner,
            seen: Mutex::new(Seen::default()),
        }
    }

    /// Whether this process read `key` from the store without having written it there,
    /// since the last call for `key`: each such read is counted once, at the promotion it
    /// served (a later promotion of the same block from another tier, a local file tier this
    /// node cascaded it to, is not another node's).
    pub fn take_foreign(&self, key: &Key) -> bool {
        lock(&self.seen).foreign.remove(key)
    }

    fn wrote(&self, key: &Key) {
        let mut seen = lock(&self.seen);
        seen.foreign.remove(key);
        seen.written.insert(key.clone());
    }

    fn read(&self, key: &Key) {
        let mut seen = lock(&self.seen);
        if !seen.written.contains(key) {
            seen.foreign.insert(key.clone());
        }
    }
}

impl<S: SecondaryStore> SecondaryStore for Tracked<S> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn kind(&self) -> TierKind {
        self.inner.kind()
    }

    fn capacity_blocks(&self) -> u32 {
        self.inner.capacity_blocks()
    }

    fn put(&self, key: &Key, block: &[u8]) -> Result<(), StoreError> {
        self.inner.put(key, block)?;
        self.wrote(key);
        Ok(())
    }

    fn get(&self, key: &Key, block: &mut [u8]) -> Result<(), StoreError> {
        self.inner.get(key, block)?;
        self.read(key);
        Ok(())
    }

    fn put_many(&self, blocks: &[(&Key, &[u8])]) -> Vec<Result<(), StoreError>> {
        let results = self.inner.put_many(blocks);
        for ((k, _), r) in blocks.iter().zip(&results) {
            if r.is_ok() {
                self.wrote(k);
            }
        }
        results
    }

    fn get_many(&self, blocks: &mut [(&Key, &mut [u8])]) -> Vec<Result<(), StoreError>> {
        let results = self.inner.get_many(blocks);
        for ((k, _), r) in blocks.iter().zip(&results) {
            if r.is_ok() {
                self.read(k);
            }
        }
        results
    }

    fn delete(&self, key: &Key) -> Result<(), StoreError> {
        self.inner.delete(key)
    }

    fn contains(&self, key: &Key) -> Result<bool, StoreError> {
        self.inner.contains(key)
    }

    fn contains_many(&self, keys: &[&Key]) -> Vec<Result<bool, StoreError>> {
        self.inner.contains_many(keys)
    }

    fn check(&self) -> Result<(), StoreError> {
        self.inner.check()
    }

    fn recovered(&self) -> Vec<Key> {
        self.inner.recovered()
    }
}

/// A node's line to its parent (written).
#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum Out<'a> {
    Progress {
        done: u64,
        total: u64,
    },
    Done {
        summary: NodeSummary,
        report: &'a Report,
    },
}

/// A node's line to its parent (read).
#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum In {
    Progress {
        done: u64,
        total: u64,
    },
    Done {
        summary: NodeSummary,
        report: serde_json::Value,
    },
}

fn send(line: &Out<'_>) {
    let text = serde_json::to_string(line).expect("a node's line serializes");
    // A parent that is gone cannot read it; the node ends at its death signal.
    let _ = writeln!(std::io::stdout().lock(), "{text}");
}

/// The [`Progress`] of a node: its progress goes to the parent as lines on stdout; it stops
/// when a signal asks it to (`stop` is what the signal handlers set, 0 for none).
pub struct NodeProgress {
    stop: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl NodeProgress {
    /// A node's progress, stopping when `stop` is set.
    pub fn new(stop: std::sync::Arc<std::sync::atomic::AtomicUsize>) -> Self {
        NodeProgress { stop }
    }
}

impl Progress for NodeProgress {
    fn update(&mut self, done: u64, total: u64) {
        send(&Out::Progress { done, total });
    }

    fn stop_requested(&self) -> bool {
        self.stop.load(std::sync::atomic::Ordering::Relaxed) != 0
    }
}

/// Sends a node's report to its parent (a line on stdout).
pub fn send_report(report: &Report) {
    send(&Out::Done {
        summary: NodeSummary::of(report),
        report,
    });
}

/// Makes this node end with its parent: the kernel sends it SIGTERM when the parent dies
/// (which stops it as a signal does: jobs ended, region and temporary tiers removed). A
/// parent already gone (its id in [`PARENT_ENV`] is not this process's parent) ends the node
/// at once.
pub fn follow_parent() -> Result<(), BenchError> {
    let lost = || {
        BenchError::Config {
        path: "-".into(),
        reason: "node (--node): the parent process is gone, or this process was not started by `kvtier bench --nodes`".into(),
    }
    };
    let parent: u32 = std::env::var(PARENT_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(lost)?;
    if let Err(e) = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM) {
        tracing::warn!(error = %e, "no signal at the parent's death: a killed parent leaves this node running");
    }
    // Checked after asking for the signal: a parent that died before is seen here.
    if std::os::unix::process::parent_id() != parent {
        return Err(lost());
    }
    Ok(())
}

/// What one node's report says, condensed; also the sum over nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeSummary {
    /// Requests replayed.
    pub requests: u64,
    /// Block references.
    pub blocks: u64,
    /// Blocks served from the primary at the first lookup.
    pub primary_hits: u64,
    /// Blocks served by a promotion.
    pub promoted_hits: u64,
    /// Blocks served after another request's store.
    pub pending_hits: u64,
    /// Promoted hits on blocks another node stored in the shared tier.
    pub cross_node_hits: u64,
    /// Promotions that failed.
    pub promotions_failed: u64,
    /// Failed reads and writes of the secondary tiers.
    pub tier_failures: u64,
    /// Loaded blocks that differed from what was stored (must be 0).
    pub wrong_blocks: u64,
    /// Wall time in seconds (the sum: the longest node's).
    pub wall_s: f64,
}

impl NodeSummary {
    /// The summary of one node's report.
    pub fn of(r: &Report) -> Self {
        NodeSummary {
            requests: r.requests,
            blocks: r.blocks,
            primary_hits: r.primary_hits,
            promoted_hits: r.promoted_hits,
            pending_hits: r.pending_hits,
            cross_node_hits: r.cross_node_hits,
            promotions_failed: r.promotions.failed,
            tier_failures: r.tiers.iter().map(|t| t.failures).sum(),
            wrong_blocks: r.wrong_blocks,
            wall_s: r.wall_s,
        }
    }

    /// Every hit.
    pub fn hits(&self) -> u64 {
        self.primary_hits + self.promoted_hits + self.pending_hits
    }

    /// Hits per block reference.
    pub fn hit_ratio(&self) -> f64 {
        self.hits() as f64 / self.blocks.max(1) as f64
    }

    /// The part of the hits that were blocks another node stored.
    pub fn cross_node_share(&self) -> f64 {
        self.cross_node_hits as f64 / self.hits().max(1) as f64
    }

    fn add(mut self, o: &NodeSummary) -> Self {
        self.requests += o.requests;
        self.blocks += o.blocks;
        self.primary_hits += o.primary_hits;
        self.promoted_hits += o.promoted_hits;
        self.pending_hits += o.pending_hits;
        self.cross_node_hits += o.cross_node_hits;
        self.promotions_failed += o.promotions_failed;
        self.tier_failures += o.tier_failures;
        self.wrong_blocks += o.wrong_blocks;
        self.wall_s = self.wall_s.max(o.wall_s);
        self
    }
}

/// What a run of several nodes measured: each node's summary and report, and the totals.
#[derive(Clone, Debug, Serialize)]
pub struct NodesReport {
    /// Each node's summary, by index.
    pub nodes: Vec<NodeSummary>,
    /// The sum over the nodes (hit ratios over every node's blocks).
    pub total: NodeSummary,
    /// The hit ratio over every node's blocks.
    pub hit_ratio: f64,
    /// The part of all hits that were blocks another node stored.
    pub cross_node_share: f64,
    /// Bytes per block.
    pub block_bytes: u64,
    /// The run's wall time, nodes started to nodes ended, in seconds.
    pub wall_s: f64,
    /// Each node's full report, as it sent it.
    pub reports: Vec<serde_json::Value>,
}

impl std::fmt::Display for NodesReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pct = |x: f64| format!("{:.1}%", x * 100.0);
        writeln!(
            f,
            "nodes           {} processes sharing the Redis tier, conversations dealt round-robin; {} blocks",
            self.nodes.len(),
            fmt_bytes(self.block_bytes)
        )?;
        writeln!(
            f,
            "{:<6} {:>8} {:>8} {:>7} {:>8} {:>8} {:>8} {:>10} {:>8} {:>8} {:>6} {:>7}",
            "node",
            "requests",
            "blocks",
            "hits",
            "primary",
            "promoted",
            "pending",
            "cross-node",
            "of hits",
            "failures",
            "wrong",
            "wall s"
        )?;
        let row = |f: &mut std::fmt::Formatter<'_>, name: &str, s: &NodeSummary| {
            writeln!(
                f,
                "{:<6} {:>8} {:>8} {:>7} {:>8} {:>8} {:>8} {:>10} {:>8} {:>8} {:>6} {:>7.1}",
                name,
                s.requests,
                s.blocks,
                pct(s.hit_ratio()),
                pct(s.primary_hits as f64 / s.blocks.max(1) as f64),
                pct(s.promoted_hits as f64 / s.blocks.max(1) as f64),
                pct(s.pending_hits as f64 / s.blocks.max(1) as f64),
                s.cross_node_hits,
                pct(s.cross_node_share()),
                s.tier_failures,
                s.wrong_blocks,
                s.wall_s
            )
        };
        for (i, s) in self.nodes.iter().enumerate() {
            row(f, &i.to_string(), s)?;
        }
        row(f, "all", &self.total)?;
        writeln!(
            f,
            "cross-node      {} of {} hits ({}) were blocks another node stored in the shared tier",
            self.total.cross_node_hits,
            self.total.hits(),
            pct(self.cross_node_share)
        )?;
        writeln!(
            f,
            "verified        {} loaded blocks differed from what was stored",
            self.total.wrong_blocks
        )?;
        write!(f, "wall time       {:.1} s", self.wall_s)
    }
}

/// What the parent hears from its nodes' pipes.
enum Heard {
    Line(u32, In),
    Garbled(u32, String),
    Log(u32, String),
    /// Node `i`'s stdout or stderr closed.
    Closed(u32),
}

/// The nodes' processes: stopped (SIGTERM, then SIGKILL after a grace period) when dropped.
struct Nodes(Vec<(Child, Option<ExitStatus>)>);

impl Nodes {
    fn signal_live(&mut self, signal: nix::sys::signal::Signal) {
        for (child, status) in &mut self.0 {
            if status.is_none() {
                let pid = nix::unistd::Pid::from_raw(child.id() as i32);
                let _ = nix::sys::signal::kill(pid, signal);
            }
        }
    }

    /// Records the exit of every node that has ended; whether all have.
    fn reap(&mut self) -> bool {
        for (child, status) in &mut self.0 {
            if status.is_none() {
                *status = child.try_wait().ok().flatten();
            }
        }
        self.0.iter().all(|(_, s)| s.is_some())
    }

    /// Kills (SIGKILL) every node still running and waits for it; the indices of those it
    /// killed.
    fn kill_live(&mut self) -> Vec<u32> {
        let mut killed = Vec::new();
        for (i, (child, status)) in self.0.iter_mut().enumerate() {
            if status.is_none() {
                let _ = child.kill();
                *status = child.wait().ok();
                killed.push(i as u32);
            }
        }
        killed
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        if self.reap() {
            return;
        }
        self.signal_live(nix::sys::signal::Signal::SIGTERM);
        let start = Instant::now();
        while !self.reap() && start.elapsed() < STOP_GRACE {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill_live();
    }
}

/// How long the nodes have to end after a stop (SIGTERM: an interrupt, or a node that
/// failed) before they are killed (SIGKILL).
pub const STOP_GRACE: Duration = Duration::from_secs(30);

/// `nodes` as "node 1" or "nodes 0, 2".
fn node_list(nodes: &[u32]) -> String {
    let list: Vec<String> = nodes.iter().map(u32::to_string).collect();
    let noun = if nodes.len() == 1 { "node" } else { "nodes" };
    format!("{noun} {}", list.join(", "))
}

/// Runs `nodes` node processes, `command(i)` being node `i`'s (its program and arguments; this
/// sets its stdio, its process group and [`PARENT_ENV`]), and adds up their reports.
///
/// Each node runs in its own process group, so a Ctrl-C at the terminal reaches the parent
/// alone; when `progress` asks to stop, the parent sends SIGTERM to every node (each ends its
/// jobs and removes its files) and answers [`BenchError::Interrupted`]. A node that fails
/// (it ends unsuccessfully without a report) stops the others the same way and is
/// [`BenchError::Node`]. After a stop, the nodes that have not ended within [`STOP_GRACE`]
/// are killed, and the log and the error name them. A node's log lines (its stderr) go to
/// [`Progress::log`] prefixed with `node i:`.
pub fn run_nodes(
    nodes: u32,
    command: &dyn Fn(u32) -> Command,
    progress: &mut dyn Progress,
) -> Result<NodesReport, BenchError> {
    run_nodes_within(nodes, command, progress, STOP_GRACE)
}

/// [`run_nodes`], the nodes given `grace` to end after a stop.
fn run_nodes_within(
    nodes: u32,
    command: &dyn Fn(u32) -> Command,
    progress: &mut dyn Progress,
    grace: Duration,
) -> Result<NodesReport, BenchError> {
    let start = Instant::now();
    let (tx, rx) = mpsc::channel();
    let mut children = Nodes(Vec::new());
    let mut readers = Vec::new();
    for i in 0..nodes {
        let mut c = command(i);
        let program = std::path::PathBuf::from(c.get_program());
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .env(PARENT_ENV, std::process::id().to_string());
        let mut child = c.spawn().map_err(|e| BenchError::Io {
            what: "start node",
            path: program,
            source: e,
        })?;
        let (out, err) = (child.stdout.take(), child.stderr.take());
        children.0.push((child, None));
        if let Some(out) = out {
            let tx = tx.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    let heard = match serde_json::from_str(&line) {
                        Ok(m) => Heard::Line(i, m),
                        Err(_) => Heard::Garbled(i, line),
                    };
                    let _ = tx.send(heard);
                }
                let _ = tx.send(Heard::Closed(i));
            }));
        }
        if let Some(err) = err {
            let tx = tx.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    let _ = tx.send(Heard::Log(i, line));
                }
                let _ = tx.send(Heard::Closed(i));
            }));
        }
    }
    drop(tx);
    let n = nodes as usize;
    let mut done = vec![0u64; n];
    let mut totals = vec![0u64; n];
    let mut results: Vec<Option<(NodeSummary, serde_json::Value)>> = vec![None; n];
    let mut open_pipes = readers.len();
    // Each node's pipes still open: its report, if it sent one, was heard once they closed.
    let mut node_pipes = vec![2u8; n];
    // When the nodes were told to stop, and the first node that failed (it ended
    // unsuccessfully without a report), if one did.
    let mut stopped: Option<Instant> = None;
    let mut failed: Option<u32> = None;
    let mut killed = Vec::new();
    loop {
        let ended = children.reap();
        if ended && open_pipes == 0 {
            break;
        }
        // After a stop, nodes end unsuccessfully because of it: none of them is the failure.
        if failed.is_none() && stopped.is_none() {
            failed = children
                .0
                .iter()
                .zip(&results)
                .zip(&node_pipes)
                .position(|(((_, status), r), &pipes)| {
                    status.is_some_and(|s| !s.success()) && pipes == 0 && r.is_none()
                })
                .map(|i| i as u32);
        }
        if stopped.is_none() && (progress.stop_requested() || failed.is_some()) {
            stopped = Some(Instant::now());
            children.signal_live(nix::sys::signal::Signal::SIGTERM);
        }
        if stopped.is_some_and(|t| t.elapsed() >= grace) {
            if !ended {
                killed = children.kill_live();
                progress.log(&format!(
                    "{} did not end within {grace:?} of the stop: killed",
                    node_list(&killed)
                ));
            }
            // A pipe that something else still holds open (a process a node started) is
            // not waited for.
            break;
        }
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(Heard::Line(i, In::Progress { done: d, total })) => {
                done[i as usize] = d;
                totals[i as usize] = total;
                progress.update(done.iter().sum(), totals.iter().sum());
            }
            Ok(Heard::Line(i, In::Done { summary, report })) => {
                done[i as usize] = summary.requests;
                results[i as usize] = Some((summary, report));
            }
            Ok(Heard::Garbled(i, line)) => progress.log(&format!("node {i}: {line}")),
            Ok(Heard::Log(i, line)) => progress.log(&format!("node {i}: {line}")),
            Ok(Heard::Closed(i)) => {
                open_pipes -= 1;
                node_pipes[i as usize] -= 1;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            // Every pipe closed: only the exits are left to wait for.
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                open_pipes = 0;
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    if open_pipes == 0 {
        for r in readers {
            let _ = r.join();
        }
    }
    let killed_note = if killed.is_empty() {
        String::new()
    } else {
        format!(
            "; {} did not end within {grace:?} of the stop and were killed",
            node_list(&killed)
        )
    };
    if let Some(node) = failed {
        let (_, status) = &children.0[node as usize];
        let status = status.expect("a failed node was reaped");
        return Err(BenchError::Node {
            node,
            nodes,
            reason: format!(
                "{status} (its messages above start with \"node {node}:\"); the other nodes were stopped{killed_note}"
            ),
        });
    }
    if stopped.is_some() || progress.stop_requested() {
        return Err(BenchError::Interrupted {
            done: done.iter().sum(),
            total: totals.iter().sum(),
        });
    }
    let mut summaries = Vec::with_capacity(n);
    let mut reports = Vec::with_capacity(n);
    for (i, ((_, status), result)) in children.0.iter().zip(&mut results).enumerate() {
        let status = status.expect("every node was reaped");
        match result.take() {
            // A node that served wrong data exits 1 after sending its report: the sum says so.
            Some((summary, report)) if status.success() || summary.wrong_blocks > 0 => {
                summaries.push(summary);
                reports.push(report);
            }
            _ => {
                return Err(BenchError::Node {
                    node: i as u32,
                    nodes,
                    reason: format!("{status} (its messages above start with \"node {i}:\")"),
                });
            }
        }
    }
    let total = summaries
        .iter()
        .fold(NodeSummary::default(), |t, s| t.add(s));
    let block_bytes = reports
        .first()
        .and_then(|r| r.get("block_bytes"))
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0);
    Ok(NodesReport {
        hit_ratio: total.hit_ratio(),
        cross_node_share: total.cross_node_share(),
        nodes: summaries,
        total,
        block_bytes,
        wall_s: start.elapsed().as_secs_f64(),
        reports,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::Synthetic;

    /// The synthetic workload's own conversation of a request: its first block after the
    /// system prompt is `(conversation << 40) | (session << 20)`, a new session being a new
    /// conversation.
    fn truth(r: &Request, system_blocks: usize) -> u64 {
        r.blocks[system_blocks] >> 20
    }

    /// A synthetic workload of short conversations.
    fn short(requests: usize, conversations: u32) -> Synthetic {
        Synthetic {
            requests,
            conversations,
            max_blocks: 24,
            ..Synthetic::default()
        }
    }

    #[test]
    fn the_split_is_deterministic_keeps_conversations_whole_and_spreads_them() {
        let s = short(2000, 300);
        let requests = s.generate();
        let sys = s.system_blocks as usize;
        let nodes = nodes_of(&requests, 3);
        assert_eq!(nodes, nodes_of(&requests, 3), "deterministic");
        assert_eq!(nodes.len(), requests.len(), "one node per request");
        // Each true conversation on one node, and each of our conversations one true one.
        let mut node_of_truth: HashMap<u64, u32> = HashMap::new();
        let mut truth_of_conv: HashMap<u32, u64> = HashMap::new();
        for ((r, &n), c) in requests.iter().zip(&nodes).zip(conversations(&requests)) {
            let t = truth(r, sys);
            assert_eq!(
                *node_of_truth.entry(t).or_insert(n),
                n,
                "conversation {t:x} split"
            );
            assert_eq!(
                *truth_of_conv.entry(c).or_insert(t),
                t,
                "conversations merged"
            );
        }
        assert_eq!(node_of_truth.len(), truth_of_conv.len());
        // Every request in exactly one share, in order; every node has some.
        let shares: Vec<Vec<Request>> = (0..3).map(|i| node_share(&requests, i, 3)).collect();
        assert!(shares.iter().all(|s| !s.is_empty()));
        let mut taken = [0usize; 3];
        for (r, &n) in requests.iter().zip(&nodes) {
            let share = &shares[n as usize];
            assert_eq!(&share[taken[n as usize]], r);
            taken[n as usize] += 1;
        }
        assert_eq!(
            taken.iter().sum::<usize>(),
            requests.len(),
            "nothing left over"
        );
        // One node: everything, as it was.
        assert_eq!(node_share(&requests, 0, 1), requests);
    }

    /// A node reading a trace keeps its own requests alone: the same share, in the same
    /// order, as dealing the whole trace; `--requests` still counts every request.
    #[test]
    fn a_node_reading_a_trace_keeps_its_share_alone() {
        let mut requests = short(600, 80).generate();
        // Some requests end with a partial block (their input is not whole blocks).
        for (i, r) in requests.iter_mut().enumerate() {
            r.partial_last = i % 3 == 0;
            // Every 21st request a single partial block: no whole block at all.
            if i % 21 == 0 {
                r.blocks.truncate(1);
            }
        }
        let text: String = requests
            .iter()
            .map(|r| {
                let tokens = r.blocks.len() as u64 * 512 - u64::from(r.partial_last);
                format!(
                    "{{\"timestamp\": 0, \"input_length\": {tokens}, \"output_length\": 1, \"hash_ids\": {:?}}}\n",
                    r.blocks
                )
            })
            .collect();
        let path = std::path::Path::new("t");
        // Whole traces and their first 400 requests, over three nodes and one.
        let cases = [(usize::MAX, 3), (400, 3), (usize::MAX, 1)];
        // As a run replays the trace: whole blocks, or `--partial-blocks`. A node deals the
        // requests the parent replays, in whole blocks too: lines with no whole block (the
        // single-block requests with a partial block) take no conversation.
        for partial in [false, true] {
            for (limit, nodes) in cases {
                let limits = crate::bench::TraceLimits {
                    max_requests: limit,
                    ..crate::bench::TraceLimits::default()
                };
                let all = crate::bench::parse_trace_replayed(
                    text.as_bytes(),
                    path,
                    limits,
                    partial,
                    None,
                )
                .unwrap();
                let dropped = requests[..requests.len().min(limit)]
                    .iter()
                    .filter(|r| r.blocks.len() == 1 && r.partial_last)
                    .count();
                assert!(partial || dropped > 0, "some lines have no whole block");
                assert_eq!(
                    all.len() + if partial { 0 } else { dropped },
                    requests.len().min(limit)
                );
                for node in 0..nodes {
                    let share = crate::bench::parse_trace_replayed(
                        text.as_bytes(),
                        path,
                        limits,
                        partial,
                        Some((node, nodes)),
                    )
                    .unwrap();
                    assert_eq!(share, node_share(&all, node, nodes), "node {node}");
                }
            }
        }
        for (limit, nodes) in cases {
            let limits = crate::bench::TraceLimits {
                max_requests: limit,
                ..crate::bench::TraceLimits::default()
            };
            let read = requests.len().min(limit);
            for node in 0..nodes {
                let mut c = Conversations::default();
                let share = crate::bench::parse_trace_keeping(text.as_bytes(), path, limits, |r| {
                    c.is_nodes(r, node, nodes)
                })
                .unwrap();
                assert_eq!(
                    share,
                    node_share(&requests[..read], node, nodes),
                    "node {node}"
                );
            }
        }
    }

    /// A log of what `run_nodes` says; it asks to stop once every file of `stop_when` exists
    /// (the nodes that write them are ready for the signal).
    struct Heard {
        stop_when: Option<Vec<std::path::PathBuf>>,
        lines: Vec<String>,
    }

    impl Progress for Heard {
        fn update(&mut self, _: u64, _: u64) {}
        fn stop_requested(&self) -> bool {
            self.stop_when
                .as_ref()
                .is_some_and(|files| files.iter().all(|f| f.exists()))
        }
        fn log(&mut self, line: &str) {
            self.lines.push(line.to_owned());
        }
    }

    /// Runs one node per script, each `scripts[i]` run by `sh` with `$DIR` a directory of
    /// the test's, given 3 s to end after a stop; when `stop_when` names files (in
    /// `$DIR`), an interrupt comes once they all exist. The error, and the lines logged.
    /// (`exec sleep` leaves no process behind the node, and keeps an ignored SIGTERM
    /// ignored.)
    fn run_scripts(scripts: &[&str], stop_when: Option<&[&str]>) -> (BenchError, Vec<String>) {
        let dir = tempfile::tempdir().unwrap();
        let mut heard = Heard {
            stop_when: stop_when.map(|names| names.iter().map(|n| dir.path().join(n)).collect()),
            lines: Vec::new(),
        };
        let command = |i: u32| {
            let mut c = Command::new("sh");
            c.arg("-c").arg(scripts[i as usize]).env("DIR", dir.path());
            c
        };
        // Long enough that a node ending on SIGTERM is reaped within it on a loaded machine.
        let grace = Duration::from_secs(3);
        let n = scripts.len() as u32;
        let e = run_nodes_within(n, &command, &mut heard, grace).unwrap_err();
        (e, heard.lines)
    }

    /// A node that fails stops the others; one that does not end after the stop is killed
    /// after the grace period, and the error and the log name it.
    #[test]
    fn a_failed_node_stops_the_others_and_one_that_does_not_end_is_killed() {
        let (e, lines) = run_scripts(
            &[
                "trap '' TERM; touch \"$DIR/0\"; exec sleep 60",
                "exec sleep 60",
                "until [ -e \"$DIR/0\" ]; do sleep 0.01; done; echo broken >&2; exit 3",
            ],
            None,
        );
        let BenchError::Node { node, reason, .. } = &e else {
            panic!("{e}");
        };
        assert_eq!(*node, 2, "{e}");
        assert!(reason.contains("exit status: 3"), "{e}");
        assert!(
            reason.contains("node 0 did not end") && reason.contains("killed"),
            "{e}"
        );
        assert!(lines.iter().any(|l| l == "node 2: broken"), "{lines:?}");
    }

    /// An interrupt: the nodes that do not end after SIGTERM are killed after the grace
    /// period, and the log names them.
    #[test]
    fn after_an_interrupt_nodes_that_do_not_end_are_killed_and_named() {
        let (e, lines) = run_scripts(
            &[
                "exec sleep 60",
                "trap '' TERM; touch \"$DIR/1\"; exec sleep 60",
                "trap '' TERM; touch \"$DIR/2\"; exec sleep 60",
            ],
            Some(&["1", "2"]),
        );
        assert!(matches!(e, BenchError::Interrupted { .. }), "{e}");
        let killed = |l: &String| l.starts_with("nodes 1, 2 did not end") && l.ends_with("killed");
        assert!(lines.iter().any(killed), "{lines:?}");
    }

    #[test]
    fn a_turn_that_appends_to_a_partial_block_continues_its_conversation() {
        let partial = |blocks: Vec<u64>| Request {
            blocks,
            partial_last: true,
        };
        let requests = vec![
            // A system prompt (1, 2) and a first turn: a full block 3, a partial block 4.
            partial(vec![1, 2, 3, 4]),
            // Its next turn: block 4 came back as 5 (filled up), then more.
            partial(vec![1, 2, 3, 5, 6]),
            // Another conversation on the same system prompt.
            partial(vec![1, 2, 7, 8]),
            // A third turn of the first: block 6 came back as 9.
            Request::new(vec![1, 2, 3, 5, 9, 10]),
            // Asked again, word for word (full blocks: the same ids).
            Request::new(vec![1, 2, 3, 5, 9, 10]),
            // Extends the full request before it (every block of it).
            Request::new(vec![1, 2, 3, 5, 9, 10, 11]),
            // Shares only the system prompt: new conversations.
            Request::new(vec![1, 2, 16]),
            Request::new(vec![1, 2, 18, 19]),
        ];
        assert_eq!(conversations(&requests), vec![0, 0, 1, 0, 0, 0, 2, 3]);
        assert_eq!(nodes_of(&requests, 2), vec![0, 0, 1, 0, 0, 0, 0, 1]);
    }
}
