//! proptest-state-machine: op sequences through the [`Harness`] (the core against the
//! `RefModel`), shrunk to a minimal failing sequence on a mismatch. Regressions are kept in
//! `model/proptest-regressions/`.

use kvtier_model::{ConfigChoice, Harness, Op};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};

/// Drives generation: the configuration is chosen once, ops are drawn from the alphabet.
/// Which job an op ends is an index taken modulo the jobs owed, so every op is valid in every
/// state and shrinking never needs preconditions.
struct Alphabet;

impl ReferenceStateMachine for Alphabet {
    type State = ConfigChoice;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Self::State> {
        ConfigChoice::strategy().boxed()
    }

    fn transitions(_: &Self::State) -> BoxedStrategy<Self::Transition> {
        Op::strategy().boxed()
    }

    fn apply(state: Self::State, _: &Self::Transition) -> Self::State {
        state
    }
}

struct CoreAgainstModel;

impl StateMachineTest for CoreAgainstModel {
    type SystemUnderTest = Harness;
    type Reference = Alphabet;

    fn init_test(choice: &ConfigChoice) -> Harness {
        Harness::new(choice.config()).expect("choices are valid")
    }

    fn apply(mut h: Harness, _: &ConfigChoice, op: Op) -> Harness {
        if let Err(m) = h.apply(&op) {
            panic!("{m}");
        }
        h
    }

    fn teardown(mut h: Harness, _: ConfigChoice) {
        if let Err(m) = h.settle() {
            panic!("{m}");
        }
    }
}

prop_state_machine! {
    #![proptest_config(Config {
        cases: 10_000,
        max_shrink_iters: 10_000,
        // Relative to the package (cargo runs tests there): model/proptest-regressions/.
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/state_machine.txt",
        ))),
        .. Config::default()
    })]
    #[test]
    fn core_agrees_with_reference_model(sequential 1..64 => CoreAgainstModel);
}
