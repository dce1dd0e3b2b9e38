//! Replays the committed fuzz corpus (`fuzz/corpus/`) through the fuzz targets' bodies on
//! stable, so every input the fuzzer found interesting stays a regression test.

use std::path::Path;

fn replay(target: &str, body: fn(&[u8])) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .collect();
    inputs.sort();
    for path in &inputs {
        let data = std::fs::read(path).expect("corpus file");
        body(&data);
    }
    inputs.len()
}

#[test]
fn ops_corpus_replays() {
    assert!(replay("ops", kvtier_model::fuzz_ops) > 100);
}

#[test]
fn config_corpus_replays() {
    assert!(replay("config", kvtier_model::fuzz_config) > 100);
}
