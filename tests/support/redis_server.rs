//! Real Redis servers for the tests: `redis-server` processes on free loopback ports, a single
//! node (optionally with TLS, its certificates made by a test CA) or a cluster made with
//! `redis-cli --cluster create`. Each server lives in its own temporary directory and is
//! killed when dropped.
//!
//! Tests run in parallel, so a port found free may be taken by another test's server before
//! ours binds it. A server counts as started only when the process that answers on the port
//! says its pid is our child's (`INFO server`); otherwise it is stopped and started again on
//! another port.

#![allow(dead_code)] // each test binary uses a part

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` on 127.0.0.1, killed on drop.
pub(crate) struct Server {
    child: Child,
    port: u16,
    password: Option<String>,
    /// With TLS: the CA that signed the server's certificate (for `redis-cli`).
    tls_ca: Option<PathBuf>,
    _dir: tempfile::TempDir,
}

/// Where a cluster node's bus listens: the port plus 10000.
const BUS_OFFSET: u16 = 10000;

/// A port nobody listens on now (the server takes it right after); with `bus`, its cluster
/// bus port is free too.
fn free_port(bus: bool) -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
        let port = l.local_addr().expect("a bound address").port();
        if !bus {
            return port;
        }
        let free_bus = port
            .checked_add(BUS_OFFSET)
            .is_some_and(|b| TcpListener::bind(("127.0.0.1", b)).is_ok());
        if free_bus {
            return port;
        }
    }
}

/// The files of a TLS server: a test CA, and a certificate it signed for 127.0.0.1.
pub(crate) struct TlsFiles {
    /// The CA's certificate (PEM): what a client trusts.
    pub(crate) ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

impl TlsFiles {
    /// Makes a CA and a server certificate for `127.0.0.1` and `localhost` in `dir`.
    pub(crate) fn make(dir: &Path) -> TlsFiles {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
        };
        let ca_key = KeyPair::generate().expect("a CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "kvtier test CA");
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key).expect("the CA certificate");
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate().expect("a server key");
        let mut server =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .expect("server parameters");
        server
            .distinguished_name
            .push(DnType::CommonName, "kvtier test server");
        let cert = server
            .signed_by(&key, &issuer)
            .expect("the server certificate");
        let files = TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join("server.pem"),
            key: dir.join("server.key"),
        };
        std::fs::write(&files.ca, ca_cert.pem()).unwrap();
        std::fs::write(&files.cert, cert.pem()).unwrap();
        std::fs::write(&files.key, key.serialize_pem()).unwrap();
        files
    }
}

fn program(name: &str) -> String {
    let found = Command::new(name)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "{name} is not installed: the Redis tier's tests run real servers \
         (Debian's redis-server package; scripts/test.sh installs it)"
    );
    name.to_owned()
}

impl Server {
    /// A single server, with `extra` arguments (`--requirepass x`, `--maxmemory ...`).
    pub(crate) fn start(extra: &[&str]) -> Server {
        Self::launch(extra, None, false)
    }

    /// A single server that speaks TLS only, with the certificates of `tls`.
    pub(crate) fn start_tls(tls: &TlsFiles) -> Server {
        Self::launch(&[], Some(tls), false)
    }

    /// A cluster node (its bus port, the port + 10000, is free too).
    fn start_node(extra: &[&str]) -> Server {
        Self::launch(extra, None, true)
    }

    fn launch(extra: &[&str], tls: Option<&TlsFiles>, bus: bool) -> Server {
        let server = program("redis-server");
        let password = extra
            .iter()
            .position(|a| *a == "--requirepass")
            .map(|i| extra[i + 1].to_owned());
        let mut last_log = String::new();
        for _ in 0..10 {
            let dir = tempfile::tempdir().expect("a directory for the server");
            let port = free_port(bus).to_string();
            let mut args: Vec<&str> = vec![
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                dir.path().to_str().expect("utf-8 path"),
                "--logfile",
                "server.log",
            ];
            let tls_paths;
            match tls {
                None => args.extend(["--port", &port]),
                Some(t) => {
                    tls_paths = [&t.cert, &t.key, &t.ca].map(|p| p.to_str().expect("utf-8 path"));
                    args.extend(["--port", "0", "--tls-port", &port]);
                    args.extend(["--tls-cert-file", tls_paths[0]]);
                    args.extend(["--tls-key-file", tls_paths[1]]);
                    args.extend(["--tls-ca-cert-file", tls_paths[2]]);
                    args.extend(["--tls-auth-clients", "no"]);
                }
            }
            args.extend(extra);
            let child = Command::new(&server)
                .args(&args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server starts");
            let mut s = Server {
                child,
                port: port.parse().expect("a port"),
                password: password.clone(),
                tls_ca: tls.map(|t| t.ca.clone()),
                _dir: dir,
            };
            if s.wait_ready(Duration::from_secs(10)) {
                return s;
            }
            // The port was taken meanwhile (another test's server answers there), or the
            // server did not start: try another port.
            last_log = s.log();
            let _ = s.child.kill();
            let _ = s.child.wait();
        }
        panic!("redis-server did not start on a free port in 10 tries; its last log:\n{last_log}");
    }

    /// The server's log so far.
    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("server.log")).unwrap_or_default()
    }

    /// Waits until our child answers on the port: a reply from another process (which took
    /// the port first) does not count.
    fn wait_ready(&mut self, within: Duration) -> bool {
        let start = Instant::now();
        let pid = format!("process_id:{}", self.child.id());
        while start.elapsed() < within {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            let info = String::from_utf8_lossy(&self.cli(&["INFO", "server"]).stdout).into_owned();
            if info.lines().any(|l| l.trim() == pid) {
                return true;
            }
            if info.contains("process_id:") {
                return false; // another server has the port
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// The server's port.
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:port` (`rediss://` for a TLS server).
    pub(crate) fn url(&self) -> String {
        let scheme = if self.tls_ca.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// `redis-cli` for this server: its port, password and TLS settings.
    fn redis_cli(&self) -> Command {
        let mut c = Command::new("redis-cli");
        c.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        if let Some(p) = &self.password {
            c.args(["--no-auth-warning", "-a", p]);
        }
        if let Some(ca) = &self.tls_ca {
            c.arg("--tls").arg("--cacert").arg(ca);
        }
        c
    }

    /// Runs `redis-cli` against this server (raw output, no retries).
    pub(crate) fn cli(&self, args: &[&str]) -> Output {
        self.redis_cli()
            .args(args)
            .output()
            .expect("redis-cli runs")
    }

    /// An integer field of `INFO` (`total_connections_received`, `evicted_keys`, ...).
    pub(crate) fn info_number(&self, field: &str) -> u64 {
        let info = String::from_utf8_lossy(&self.cli(&["INFO"]).stdout).into_owned();
        info.lines()
            .find_map(|l| {
                l.trim()
                    .strip_prefix(field)?
                    .strip_prefix(':')?
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no {field} in INFO: {info}"))
    }

    /// Sets `name` to `value`, bytes as they are (`redis-cli -x` reads the value from stdin).
    pub(crate) fn set_raw(&self, name: &str, value: &[u8]) {
        use std::io::Write;
        let mut child = self
            .redis_cli()
            .args(["-x", "SET", name])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("redis-cli runs");
        child.stdin.take().unwrap().write_all(value).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.stdout.starts_with(b"OK"), "{out:?}");
    }

    /// Reads `name`'s value as it is stored.
    pub(crate) fn get_raw(&self, name: &str) -> Vec<u8> {
        let mut out = self.cli(&["--no-raw", "STRLEN", name]).stdout;
        out.retain(|b| b.is_ascii_digit());
        let len: usize = String::from_utf8(out).unwrap().parse().unwrap_or(0);
        let mut value = self.cli(&["--raw", "GET", name]).stdout;
        value.truncate(len); // redis-cli adds a newline
        value
    }

    /// Stops the process without closing its sockets: it no longer answers (SIGSTOP).
    pub(crate) fn freeze(&self) {
        signal(self.child.id(), "STOP");
    }

    /// Lets a frozen server go on (SIGCONT).
    pub(crate) fn thaw(&self) {
        signal(self.child.id(), "CONT");
    }

    /// Waits until a replica has every write made so far (`WAIT 1`), so that a failover
    /// loses none of them.
    pub(crate) fn wait_replicated(&self) {
        let out = self.cli(&["WAIT", "1", "10000"]);
        assert!(out.stdout.starts_with(b"1"), "WAIT: {out:?}");
    }

    /// Kills the server at once (SIGKILL), as a crashed machine would.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(pid: u32, name: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{name} {pid}");
}

impl Drop for Server {
    fn drop(&mut self) {
        self.thaw_quietly();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn thaw_quietly(&self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
    }
}

/// A Redis Cluster of `masters` masters with one replica each, on loopback.
pub(crate) struct Cluster {
    /// Every node, masters first as `--cluster create` assigned them.
    pub(crate) nodes: Vec<Server>,
}

impl Cluster {
    /// Starts the nodes and joins them with `redis-cli --cluster create`; waits until every
    /// node says the cluster is ok. Failover is fast: a node is failed after 1 s unreachable.
    pub(crate) fn start(masters: usize) -> Cluster {
        Self::start_with(masters, &[])
    }

    /// A cluster whose nodes run with `extra` arguments too; with `--requirepass p`, add
    /// `--masterauth p` so that replicas can sync.
    pub(crate) fn start_with(masters: usize, extra: &[&str]) -> Cluster {
        let mut args = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "1000",
        ];
        args.extend(extra);
        let nodes: Vec<Server> = (0..masters * 2)
            .map(|_| Server::start_node(&args))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut create = Command::new(program("redis-cli"));
        if let Some(p) = &nodes[0].password {
            create.args(["--no-auth-warning", "-a", p]);
        }
        create.arg("--cluster").arg("create").args(&addrs);
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        let out = create.output().expect("redis-cli --cluster create runs");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Cluster { nodes };
        cluster.wait_ok(Duration::from_secs(30));
        cluster.wait_replicas_synced(Duration::from_secs(30));
        cluster
    }

    /// Waits until every replica has synced with its master: a replica that never did has
    /// no data to take over with, and does not fail over.
    fn wait_replicas_synced(&self, within: Duration) {
        let start = Instant::now();
        loop {
            let synced = self.nodes.iter().all(|n| {
                let info =
                    String::from_utf8_lossy(&n.cli(&["INFO", "replication"]).stdout).into_owned();
                info.contains("role:master") || info.contains("master_link_status:up")
            });
            if synced {
                return;
            }
            assert!(
                start.elapsed() < within,
                "replicas not synced after {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The nodes' URLs.
    pub(crate) fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Server::url).collect()
    }

    /// Waits until every live node reports `cluster_state:ok` and none serves a slot from a
    /// dead node (after a failover, once every node knows the replica took over).
    pub(crate) fn wait_ok(&self, within: Duration) {
        let start = Instant::now();
        let live: Vec<&Server> = self.nodes.iter().filter(|n| n.is_alive()).collect();
        let dead: Vec<String> = self
            .nodes
            .iter()
            .filter(|n| !n.is_alive())
            .map(|n| n.port.to_string())
            .collect();
        loop {
            let ok = live.iter().all(|n| {
                let info =
                    String::from_utf8_lossy(&n.cli(&["CLUSTER", "INFO"]).stdout).into_owned();
                // `CLUSTER NODES`: id, ip:port@bus, flags, master, ping, pong, epoch, link,
                // then the slots the node serves.
                let nodes =
                    String::from_utf8_lossy(&n.cli(&["CLUSTER", "NODES"]).stdout).into_owned();
                let dead_serves = nodes.lines().any(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    f.len() > 8
                        && dead.iter().any(|d| {
                            f[1].split('@')
                                .next()
                                .is_some_and(|a| a.ends_with(&format!(":{d}")))
                        })
                });
                info.contains("cluster_state:ok") && !dead_serves
            });
            if ok {
                return;
            }
            assert!(
                start.elapsed() < within,
                "the cluster is not ok after {within:?} (dead: {dead:?}): {}\n{}",
                String::from_utf8_lossy(&live[0].cli(&["CLUSTER", "INFO"]).stdout),
                String::from_utf8_lossy(&live[0].cli(&["CLUSTER", "NODES"]).stdout)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The node that serves `name`'s slot as master now.
    pub(crate) fn master_of(&self, name: &str) -> usize {
        let slot =
            String::from_utf8_lossy(&self.nodes[0].cli(&["CLUSTER", "KEYSLOT", name]).stdout)
                .trim()
                .parse::<u16>()
                .expect("a slot number");
        let shards =
            String::from_utf8_lossy(&self.nodes[0].cli(&["CLUSTER", "SLOTS"]).stdout).into_owned();
        // `CLUSTER SLOTS` in raw form: start, end, then the master's ip and port (and id),
        // then the replicas'.
        let lines: Vec<&str> = shards.lines().map(str::trim).collect();
        let mut i = 0;
        while i + 3 < lines.len() {
            if let (Ok(start), Ok(end)) = (lines[i].parse::<u16>(), lines[i + 1].parse::<u16>())
                && lines[i + 2] == "127.0.0.1"
                && (start..=end).contains(&slot)
            {
                let port: u16 = lines[i + 3].parse().expect("a port");
                return self
                    .nodes
                    .iter()
                    .position(|n| n.port == port)
                    .expect("a node of ours");
            }
            i += 1;
        }
        panic!("no master for slot {slot} in {shards}");
    }
}

impl Server {
    /// Whether the process still runs.
    pub(crate) fn is_alive(&self) -> bool {
        Command::new("kill")
            .args(["-0", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
            && self.cli(&["PING"]).stdout.starts_with(b"PONG")
    }
}
