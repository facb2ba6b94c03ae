//! Replays every input under `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/`
//! through its target's check, so what the fuzzers found stays fixed on stable, in the
//! ordinary test run. A target without a seed corpus fails: each must have one.

use kvroute_invariants::TARGETS;
use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.is_file()).collect();
    files.sort();
    files
}

#[test]
fn every_target_has_a_seed_corpus_and_a_libfuzzer_entry() {
    for (name, _) in TARGETS {
        assert!(!inputs(&fuzz_dir().join("corpus").join(name)).is_empty(), "fuzz/corpus/{name} is empty");
        let target = fuzz_dir().join("fuzz_targets").join(format!("{name}.rs"));
        let text = std::fs::read_to_string(&target).unwrap_or_else(|e| panic!("{}: {e}", target.display()));
        assert!(
            text.contains(&format!("kvroute_invariants::{name}::check")),
            "{} runs another check",
            target.display()
        );
    }
}

#[test]
fn corpus_and_regressions_hold_every_invariant() {
    let mut replayed = 0;
    for (name, check) in TARGETS {
        for kind in ["corpus", "regressions"] {
            for file in inputs(&fuzz_dir().join(kind).join(name)) {
                let data = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                if std::panic::catch_unwind(|| check(&data)).is_err() {
                    panic!("{} breaks an invariant of {name} (the panic above says which)", file.display());
                }
                replayed += 1;
            }
        }
    }
    println!("{replayed} inputs replayed");
}
