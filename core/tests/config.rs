//! Rule ★7 for configuration: an invalid value is a typed error naming the field.

use kvtier_core::{
    Config, ConfigError, MAX_HORIZON_MIN_GAPS, Manager, PolicyKind, ReturnHorizon, ReuseFilter,
    TierConfig, TierKind,
};

/// A way to break one field of a valid config.
type Breaker = Box<dyn Fn(&mut Config)>;

fn field_of(c: Config) -> String {
    match Manager::new(c) {
        Err(ConfigError::Invalid { field, .. }) => field,
        Ok(_) => panic!("accepted an invalid config"),
    }
}

#[test]
fn invalid_fields_are_named() {
    let valid = || {
        let mut c = Config::new(4);
        c.tiers = vec![
            TierConfig::new(TierKind::Authoritative, 8),
            TierConfig::new(TierKind::Shared, 8),
        ];
        c
    };
    Manager::new(valid()).unwrap();

    let cases: Vec<(&str, Breaker)> = vec![
        ("num_blocks", Box::new(|c| c.num_blocks = 0)),
        (
            "num_blocks",
            Box::new(|c| c.num_blocks = kvtier_core::MAX_BLOCKS + 1),
        ),
        (
            "tiers[1].capacity_blocks",
            Box::new(|c| c.tiers[1].capacity_blocks = 0),
        ),
        (
            "tiers[0].max_outstanding_stores",
            Box::new(|c| c.tiers[0].max_outstanding_stores = 0),
        ),
        (
            "tiers[1].absent_ttl_steps",
            Box::new(|c| c.tiers[1].absent_ttl_steps = 0),
        ),
        (
            "tiers[1].policy",
            Box::new(|c| c.tiers[1].policy = PolicyKind::Reuse),
        ),
        (
            "promotion_cooldown_steps",
            Box::new(|c| c.promotion_cooldown_steps = 0),
        ),
        (
            "health.failures_to_down",
            Box::new(|c| c.health.failures_to_down = 0),
        ),
        (
            "health.probe_interval_steps",
            Box::new(|c| c.health.probe_interval_steps = 0),
        ),
        (
            "reuse.store_threshold",
            Box::new(|c| {
                c.reuse = Some(ReuseFilter {
                    store_threshold: 1,
                    max_tracker_size: 8,
                })
            }),
        ),
        (
            "return_horizon.sample",
            Box::new(|c| {
                c.return_horizon = Some(ReturnHorizon {
                    sample: 12,
                    min_gaps: 128,
                })
            }),
        ),
        (
            "return_horizon.min_gaps",
            Box::new(|c| {
                c.return_horizon = Some(ReturnHorizon {
                    sample: 16,
                    min_gaps: 0,
                })
            }),
        ),
        (
            "return_horizon.min_gaps",
            Box::new(|c| {
                c.return_horizon = Some(ReturnHorizon {
                    sample: 16,
                    min_gaps: MAX_HORIZON_MIN_GAPS + 1,
                })
            }),
        ),
        (
            "reuse.max_tracker_size",
            Box::new(|c| {
                c.reuse = Some(ReuseFilter {
                    store_threshold: 2,
                    max_tracker_size: 0,
                })
            }),
        ),
        (
            "tiers",
            Box::new(|c| c.tiers = vec![TierConfig::new(TierKind::Authoritative, 1); 65]),
        ),
    ];
    for (field, break_it) in cases {
        let mut c = valid();
        break_it(&mut c);
        assert_eq!(field_of(c), field);
    }
}

#[test]
fn error_message_names_field_and_reason() {
    let mut c = Config::new(4);
    c.tiers = vec![TierConfig::new(TierKind::Authoritative, 0)];
    let e = Manager::new(c).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid config field `tiers[0].capacity_blocks`: must be at least 1"
    );
}

#[test]
fn an_authoritative_tier_ignores_the_absent_ttl() {
    let mut c = Config::new(4);
    let mut t = TierConfig::new(TierKind::Authoritative, 8);
    t.absent_ttl_steps = 0;
    c.tiers = vec![t];
    Manager::new(c).unwrap();
}

/// The limits are inclusive: exactly `MAX_BLOCKS` slots or tier blocks and exactly
/// `MAX_TIERS` tiers are valid (validation only: nothing is allocated).
#[test]
fn limits_are_inclusive() {
    assert_eq!(
        kvtier_core::MAX_BLOCKS,
        (1 << 29) - 2,
        "ids use 30 bits, ARC ghosts included"
    );
    assert_eq!(
        kvtier_core::MAX_TIERS,
        64,
        "one cascade pin per tier fits the pin counter"
    );
    let mut c = Config::new(kvtier_core::MAX_BLOCKS);
    c.validate().unwrap();
    c.num_blocks = 4;
    c.tiers = vec![TierConfig::new(TierKind::Authoritative, kvtier_core::MAX_BLOCKS); 64];
    c.validate().unwrap();
    c.tiers[63].capacity_blocks += 1;
    assert!(matches!(
        c.validate(),
        Err(ConfigError::Invalid { field, .. }) if field == "tiers[63].capacity_blocks"
    ));
}
