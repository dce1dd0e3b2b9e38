//! The README's driver example, runnable: `cargo run -p kvtier-hw --example quickstart`.
//! A block is computed, stored, cascaded to a file tier, evicted, promoted back and loaded.

use std::sync::Arc;

use kvtier_core::{Config, Key, Lookup, RequestId, TierConfig};
use kvtier_hw::{
    Driver, DriverOptions, FileStore, HostEngine, HostMemory, Layout, Region, SecondaryStore,
};

#[allow(clippy::print_stdout)] // an example reports what it did
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?; // in production: /dev/shm for the region, an NVMe path for the tier
    let layout = Layout::new(2, 1, 256 << 10)?; // 2 slots of 256 KiB, one worker
    let region = Arc::new(Region::create(&dir.path().join("region"), layout, 2)?);
    let device = Arc::new(HostMemory::new(4 * (256 << 10))?); // stands in for GPU memory
    let engine = HostEngine::new(region.clone(), device.clone(), 0, 2);
    let tier = Arc::new(FileStore::open(
        &dir.path().join("tier"),
        layout.row_bytes(),
        64 << 20,
    )?);
    let mut config = Config::new(layout.rows);
    config.tiers = vec![TierConfig::new(tier.kind(), tier.capacity_blocks())];
    let mut driver = Driver::new(
        config,
        region,
        Box::new(engine),
        vec![tier],
        DriverOptions::default(),
    )?;

    let req = RequestId(1);
    let blocks: Vec<Key> = (0..3u8).map(|i| Key::new(&[i])).collect();
    for (i, key) in blocks.iter().enumerate() {
        device.write(0, &vec![i as u8; 256 << 10])?; // the "model" computes block i
        if let Some(t) = driver.store(req, &[(key.clone(), 0)])? {
            driver.wait(t)?; // device -> region; then the core cascades it to the file tier
        }
        driver.settle(2);
        println!("stored block {i}: device -> region, cascaded to the file tier");
    }
    let stats = driver.manager().stats();
    println!(
        "primary holds {} of {} blocks ({} evicted); the file tier holds {}",
        driver.manager().primary().len(),
        layout.rows,
        stats.evictions,
        stats.tiers[0].1.blocks
    );
    // Block 0 was evicted from the 2-slot primary; the file tier still has it.
    let mut answer = driver.lookup(req, &blocks[0]);
    while matches!(answer, Lookup::HitPending | Lookup::Retry) {
        driver.settle(1); // the promotion runs; ask again next step
        answer = driver.lookup(req, &blocks[0]);
    }
    assert_eq!(answer, Lookup::Hit);
    println!("block 0: evicted from the primary, promoted back from the file tier");
    let t = driver.load(req, &[(blocks[0].clone(), 1 << 18)])?; // region -> device
    driver.wait(t)?;
    let mut back = vec![1u8; 256 << 10];
    device.read(1 << 18, &mut back)?;
    assert!(
        back.iter().all(|&b| b == 0),
        "the promoted block has the stored bytes"
    );
    println!(
        "block 0: loaded region -> device, {} bytes verified",
        back.len()
    );
    driver.end_step();
    let report = driver.shutdown();
    assert_eq!(report.abandoned, 0);
    println!(
        "shut down: {} in-flight jobs drained, {} abandoned",
        report.drained, report.abandoned
    );
    Ok(())
}
