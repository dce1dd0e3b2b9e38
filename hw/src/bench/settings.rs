//! Bench settings: defaults, a TOML or JSON file with the keys vLLM users know, and options.

use std::path::{Path, PathBuf};

use kvtier_core::PolicyKind;

use crate::FsyncPolicy;
use serde::Deserialize;

use super::BenchError;

/// One secondary tier of the bench.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierSettings {
    /// The tier's directory; `None`: a temporary directory removed afterwards.
    pub path: Option<PathBuf>,
    /// Its capacity in bytes, record headers included (see docs/configuration.md).
    pub capacity_bytes: u64,
    /// Its eviction policy (LRU unless the tier names one).
    pub policy: PolicyKind,
    /// When its writes are made durable (the file tier's default unless the tier names one).
    pub fsync: FsyncPolicy,
}

impl TierSettings {
    /// A tier at `path` (a temporary directory when `None`) of `capacity_bytes`, LRU.
    pub fn new(path: Option<PathBuf>, capacity_bytes: u64) -> Self {
        TierSettings {
            path,
            capacity_bytes,
            policy: PolicyKind::Lru,
            fsync: FsyncPolicy::default(),
        }
    }

    /// Parses `PATH:BYTES` (the `--tier` option); `BYTES` takes units (`64GiB`, `500M`), and
    /// an empty `PATH` means a temporary directory.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let (path, bytes) = spec.rsplit_once(':').ok_or_else(|| {
            format!("expected PATH:BYTES (for example /mnt/nvme/kv:64GiB), got {spec:?}")
        })?;
        let capacity = parse_bytes(bytes)?;
        let path = (!path.is_empty()).then(|| PathBuf::from(path));
        Ok(TierSettings::new(path, capacity))
    }
}

/// Parses a byte count: a number with an optional unit (`4096`, `512KiB`, `1.5G`, `64GiB`).
/// Units are powers of 1024 (`K`, `KB` and `KiB` alike), as memory sizes are.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    parse_size::Config::new()
        .with_binary()
        .parse_size(text.trim())
        .map_err(|e| format!("{text:?} is not a byte count ({e})"))
}

/// Everything a bench run needs besides its workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchSettings {
    /// Bytes of the primary region.
    pub cpu_bytes: u64,
    /// Bytes of one block (one worker).
    pub block_bytes: usize,
    /// The primary's eviction policy (each tier has its own).
    pub policy: PolicyKind,
    /// Directory of the shared region (default `/dev/shm`).
    pub region_dir: PathBuf,
    /// Secondary tiers, in cascade order.
    pub tiers: Vec<TierSettings>,
    /// Requests in flight at a time (a scheduler's batch).
    pub batch: usize,
    /// Copy threads of the host engine.
    pub copy_threads: usize,
    /// IO threads per tier.
    pub io_threads: usize,
    /// Steps a request waits for its promotions before it recomputes instead.
    pub max_wait_steps: u32,
}

impl Default for BenchSettings {
    fn default() -> Self {
        BenchSettings {
            cpu_bytes: 1 << 30,
            block_bytes: 256 << 10,
            policy: PolicyKind::Lru,
            region_dir: PathBuf::from("/dev/shm"),
            tiers: vec![TierSettings::new(None, 4 << 30)],
            batch: 4,
            copy_threads: 2,
            io_threads: 4,
            max_wait_steps: 64,
        }
    }
}

/// A configuration file, TOML or JSON (by extension; otherwise TOML is tried, then JSON).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSettings {
    /// Bytes of the primary region.
    pub cpu_bytes_to_use: Option<u64>,
    /// Tokens per block (with `bytes_per_token`, sets the block size).
    pub block_size: Option<u64>,
    /// KV-cache bytes per token for one worker.
    pub bytes_per_token: Option<u64>,
    /// The primary's policy: "lru" or "arc" (any case).
    pub eviction_policy: Option<String>,
    /// Directory of the shared region.
    pub region_dir: Option<PathBuf>,
    /// Requests in flight at a time.
    pub batch: Option<usize>,
    /// Secondary tiers.
    pub secondary_tiers: Option<Vec<FileTier>>,
}

/// A secondary tier in a configuration file.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileTier {
    /// Only "file" for now.
    #[serde(rename = "type")]
    pub kind: String,
    /// Its directory (a temporary one when absent).
    pub path: Option<PathBuf>,
    /// Its capacity in bytes.
    pub capacity_bytes: u64,
    /// Its eviction policy: "lru" (the default) or "arc" (any case).
    pub eviction_policy: Option<String>,
    /// When its writes are made durable: "none", "batch" or "write".
    pub fsync: Option<String>,
}

/// Parses a policy name.
pub fn parse_policy(s: &str) -> Option<PolicyKind> {
    match s.to_ascii_lowercase().as_str() {
        "lru" => Some(PolicyKind::Lru),
        "arc" => Some(PolicyKind::Arc),
        _ => None,
    }
}

impl FileSettings {
    /// Reads and parses `path`.
    pub fn read(path: &Path) -> Result<Self, BenchError> {
        let text = std::fs::read_to_string(path).map_err(|e| BenchError::Io {
            what: "read config",
            path: path.to_path_buf(),
            source: e,
        })?;
        Self::parse(&text, path)
    }

    /// Parses `text`, read from `path`.
    pub fn parse(text: &str, path: &Path) -> Result<Self, BenchError> {
        let bad = |reason: String| BenchError::Config {
            path: path.to_path_buf(),
            reason,
        };
        match path.extension().and_then(|e| e.to_str()) {
            Some("json") => serde_json::from_str(text).map_err(|e| bad(e.to_string())),
            Some("toml") => toml::from_str(text).map_err(|e| bad(e.to_string())),
            _ => toml::from_str(text)
                .or_else(|t| serde_json::from_str(text).map_err(|_| bad(t.to_string()))),
        }
    }

    /// Applies the file over `s`, checking what only the file can get wrong (names, types);
    /// [`BenchSettings::validate`] checks the values once the options are applied too.
    pub fn apply(&self, s: &mut BenchSettings, path: &Path) -> Result<(), BenchError> {
        let bad = |reason: String| BenchError::Config {
            path: path.to_path_buf(),
            reason,
        };
        if let Some(b) = self.cpu_bytes_to_use {
            s.cpu_bytes = b;
        }
        match (self.block_size, self.bytes_per_token) {
            (Some(t), Some(b)) => {
                s.block_bytes = usize::try_from(t.saturating_mul(b))
                    .map_err(|_| bad("block_size * bytes_per_token is too large".into()))?
            }
            (Some(t), None) => s.block_bytes = (t as usize).saturating_mul(512),
            (None, Some(_)) => return Err(bad("bytes_per_token needs block_size".into())),
            (None, None) => {}
        }
        let policy = |field: String, p: &str| {
            parse_policy(p)
                .ok_or_else(|| bad(format!("{field}: expected \"lru\" or \"arc\", got {p:?}")))
        };
        if let Some(p) = &self.eviction_policy {
            s.policy = policy("eviction_policy".into(), p)?;
        }
        if let Some(d) = &self.region_dir {
            s.region_dir = d.clone();
        }
        if let Some(b) = self.batch {
            s.batch = b;
        }
        if let Some(tiers) = &self.secondary_tiers {
            s.tiers = tiers
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    if t.kind != "file" {
                        return Err(bad(format!(
                            "secondary_tiers[{i}].type: only \"file\" is supported, got {:?}",
                            t.kind
                        )));
                    }
                    let mut tier = TierSettings::new(t.path.clone(), t.capacity_bytes);
                    if let Some(p) = &t.eviction_policy {
                        tier.policy = policy(format!("secondary_tiers[{i}].eviction_policy"), p)?;
                    }
                    if let Some(f) = &t.fsync {
                        tier.fsync = f
                            .to_ascii_lowercase()
                            .parse()
                            .map_err(|e| bad(format!("secondary_tiers[{i}].fsync: {e}")))?;
                    }
                    Ok(tier)
                })
                .collect::<Result<_, _>>()?;
        }
        Ok(())
    }
}

impl BenchSettings {
    /// Checks the settings, once every source (defaults, file, options) is applied: the error
    /// names the setting by its file key and its option. Nothing is created before this.
    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |reason: String| {
            Err(BenchError::Config {
                path: "-".into(),
                reason,
            })
        };
        if self.block_bytes == 0 || self.block_bytes > 1 << 30 {
            return bad("block bytes (block_size × bytes_per_token, --block-bytes): must be 1 byte to 1 GiB".into());
        }
        let row = crate::page_align(self.block_bytes);
        if self.cpu_bytes < row as u64 {
            return bad(format!(
                "cpu_bytes_to_use (--cpu-bytes): {} holds no block of {} (a block takes {} in the region)",
                super::fmt_bytes(self.cpu_bytes),
                super::fmt_bytes(self.block_bytes as u64),
                super::fmt_bytes(row as u64)
            ));
        }
        if self.batch == 0 || self.batch > 256 {
            return bad("batch: must be 1 to 256".into());
        }
        for (i, t) in self.tiers.iter().enumerate() {
            if let Err(e) = crate::FileStore::capacity_for(row, t.capacity_bytes) {
                return bad(format!("secondary_tiers[{i}].capacity_bytes (--tier): {e}"));
            }
        }
        if !self.region_dir.is_dir() {
            return bad(format!(
                "region_dir (--region-dir): {} is not a directory",
                self.region_dir.display()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_keys_in_toml_and_json() {
        let toml = r#"
cpu_bytes_to_use = 268435456
block_size = 256
bytes_per_token = 1024
eviction_policy = "arc"
secondary_tiers = [{ type = "file", capacity_bytes = 1073741824 }]
"#;
        let f = FileSettings::parse(toml, Path::new("c.toml")).unwrap();
        let mut s = BenchSettings::default();
        f.apply(&mut s, Path::new("c.toml")).unwrap();
        assert_eq!(
            (s.cpu_bytes, s.block_bytes, s.policy),
            (256 << 20, 256 << 10, PolicyKind::Arc)
        );
        assert_eq!(s.tiers.len(), 1);
        let json = r#"{"cpu_bytes_to_use": 1048576, "secondary_tiers": []}"#;
        let f = FileSettings::parse(json, Path::new("c.json")).unwrap();
        f.apply(&mut s, Path::new("c.json")).unwrap();
        assert!(s.tiers.is_empty());
    }

    #[test]
    fn errors_name_the_field() {
        let err = FileSettings::parse("cpu_bytes = 1", Path::new("c.toml")).unwrap_err();
        assert!(err.to_string().contains("cpu_bytes"), "{err}");
        let f = FileSettings::parse("eviction_policy = \"fifo\"", Path::new("c.toml")).unwrap();
        let err = f
            .apply(&mut BenchSettings::default(), Path::new("c.toml"))
            .unwrap_err();
        assert!(err.to_string().contains("eviction_policy"), "{err}");
        let f = FileSettings::parse(
            "[[secondary_tiers]]\ntype = \"redis\"\ncapacity_bytes = 1",
            Path::new("c.toml"),
        )
        .unwrap();
        let err = f
            .apply(&mut BenchSettings::default(), Path::new("c.toml"))
            .unwrap_err();
        assert!(err.to_string().contains("secondary_tiers[0].type"), "{err}");
    }

    #[test]
    fn each_tier_has_its_own_policy() {
        let toml = r#"
eviction_policy = "ARC"
[[secondary_tiers]]
type = "file"
capacity_bytes = 1073741824
[[secondary_tiers]]
type = "file"
capacity_bytes = 1073741824
eviction_policy = "Arc"
fsync = "write"
"#;
        let mut s = BenchSettings::default();
        let f = FileSettings::parse(toml, Path::new("c.toml")).unwrap();
        f.apply(&mut s, Path::new("c.toml")).unwrap();
        assert_eq!(s.policy, PolicyKind::Arc, "the primary's policy, any case");
        let tiers: Vec<PolicyKind> = s.tiers.iter().map(|t| t.policy).collect();
        assert_eq!(tiers, [PolicyKind::Lru, PolicyKind::Arc]);
        assert_eq!(s.tiers[0].fsync, FsyncPolicy::default());
        assert_eq!(s.tiers[1].fsync, FsyncPolicy::Write);
        let bad =
            "[[secondary_tiers]]\ntype = \"file\"\ncapacity_bytes = 1\neviction_policy = \"mru\"";
        let err = FileSettings::parse(bad, Path::new("c.toml"))
            .unwrap()
            .apply(&mut BenchSettings::default(), Path::new("c.toml"))
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("secondary_tiers[0].eviction_policy"),
            "{err}"
        );
    }

    #[test]
    fn tier_options_and_byte_counts_parse() {
        let t = TierSettings::parse("/mnt/nvme/kv:64GiB").unwrap();
        assert_eq!(t.path.as_deref(), Some(Path::new("/mnt/nvme/kv")));
        assert_eq!(t.capacity_bytes, 64 << 30);
        let t = TierSettings::parse(":512M").unwrap();
        assert_eq!((t.path, t.capacity_bytes), (None, 512 << 20));
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("16KiB").unwrap(), 16 << 10);
        assert_eq!(parse_bytes("16kb").unwrap(), 16 << 10);
        let err = TierSettings::parse("/mnt/nvme").unwrap_err();
        assert!(err.contains("PATH:BYTES"), "{err}");
        let err = parse_bytes("lots").unwrap_err();
        assert!(err.contains("not a byte count"), "{err}");
    }
}
