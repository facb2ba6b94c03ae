//! The sidecar's checkpoint file ([`kvroute_sidecar::checkpoint`]), as a restarted sidecar
//! reads it: from disk, where it may be damaged or not the sidecar's at all.
//!
//! Input: a checkpoint's body; the check seals it (magic and checksum) as a written file
//! is, so the fuzzer reaches the records instead of stopping at the checksum.
//! - each worker's record restores whole (its cache's holder counts and engine-block
//!   parts agree: `WorkerCache::load`) or not at all, and a worker restored from nothing
//!   holds nothing;
//! - what was restored, checkpointed again and restored into a new fleet, is the same:
//!   the same blocks, engine blocks and resume points, with no record refused.

use kvroute_sidecar::checkpoint;
use kvroute_sidecar::config::{Cli, Config};
use kvroute_sidecar::fleet::Fleet;

/// Two workers, the second with two DP ranks (the seeds are checkpoints of this fleet).
pub const CONFIG: &str = "block_size = 16\n\
    [[workers]]\nid = \"10.0.0.1:8000\"\nevents = \"tcp://10.0.0.1:5557\"\n\
    [[workers]]\nid = \"10.0.0.2:8000\"\nevents = \"tcp://10.0.0.2:5557\"\ndp_ranks = 2\n";

pub fn fleet(epoch: u64) -> Fleet {
    Fleet::new(&Config::from_toml(CONFIG, &Cli::default()).expect("the fleet's config"), epoch)
}

type View = (Vec<(u64, u64, bool)>, Vec<Vec<u64>>);

fn view(f: &Fleet, w: usize) -> View {
    let cache = &f.workers[w].cache;
    let mut blocks: Vec<_> = cache.feed_blocks().map(|(b, off)| (b.hash, b.anchor, off)).collect();
    blocks.sort_unstable();
    (blocks, cache.engine_blocks())
}

pub fn check(data: &[u8]) {
    let mut f = fleet(1);
    if f.load_checkpoint(&checkpoint::seal(data)).is_err() {
        return;
    }
    let points: Vec<_> = (0..f.workers.len()).map(|k| f.restore_worker(k as u32)).collect();
    for (w, p) in f.workers.iter().zip(&points) {
        assert!(p.is_empty() || p.len() == w.ranks.len(), "{} resume points for {} ranks", p.len(), w.ranks.len());
        if p.is_empty() {
            assert_eq!(w.cache.block_count(), 0, "a worker restored from nothing holds blocks");
        }
    }
    let mut g = fleet(2);
    g.load_checkpoint(&f.checkpoint()).expect("a checkpoint the sidecar wrote loads");
    for (k, p) in points.iter().enumerate() {
        let again = g.restore_worker(k as u32);
        if !p.is_empty() {
            assert_eq!(&again, p, "resume points");
        }
        assert_eq!(view(&g, k), view(&f, k), "worker {k} after a second checkpoint");
    }
    assert_eq!(g.stats.checkpoint_errors, 0, "a record the sidecar wrote was refused");
}
