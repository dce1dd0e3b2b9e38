//! A throwaway `redis-server` on a free loopback port, killed when dropped: for the tests and
//! benches of this crate that need a real server (the repository's `tests/` crate has a fuller
//! harness, with clusters and faults).

#![allow(dead_code)] // each target uses a part

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` on 127.0.0.1 with no persistence, killed on drop.
pub(crate) struct RedisServer {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts one, with `extra` arguments (`--maxmemory ...`). Panics with the reason when
    /// `redis-server` is not installed (Debian's package; `scripts/redis-setup.sh`).
    pub(crate) fn start(extra: &[&str]) -> RedisServer {
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("a directory for the server");
            // A port nobody listens on now: the server takes it right after.
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free loopback port")
                .port();
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no", "--dir"])
                .arg(dir.path())
                .args(extra)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!("redis-server does not start ({e}): install it (scripts/redis-setup.sh)")
                });
            let mut server = RedisServer {
                child,
                port,
                _dir: dir,
            };
            if server.wait_ready(Duration::from_secs(10)) {
                return server;
            }
            // The port was taken meanwhile: try another (dropping this one kills it).
        }
        panic!("redis-server did not start on a free port in 5 tries");
    }

    fn wait_ready(&mut self, within: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < within {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            let pong = redis::Client::open(self.url())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
            if pong.is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// `redis://127.0.0.1:port`.
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A connection to it.
    pub(crate) fn connect(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection())
            .expect("a connection to the test server")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
