//! The sidecar's TOML file and its `--worker ID=EVENTS[,replay=…][,role=…][,dp=…]` flag
//! ([`kvroute_sidecar::config`]), through the same parsing the binary does.
//!
//! Input: a selector byte (even: the rest is a TOML file; odd: the rest is `--worker`
//! values, one per line), then the text.
//! - a configuration that loads holds what the ingest loop relies on: a worker list
//!   within bounds, unique ids that are `ip:port` addresses, endpoints it can dial, a
//!   block size and every interval and count at least 1; a load exchange only over NATS,
//!   on a subject outside the event stream's;
//! - an accepted `--worker`, written back in canonical form, loads to the same worker.

use clap::Parser;
use kvroute::role::Role;
use kvroute_sidecar::config::{Cli, Config, Discovery, Transport, WorkerConfig, MAX_WORKERS};
use std::net::SocketAddr;

pub fn check(data: &[u8]) {
    let (sel, rest) = crate::selector(data);
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let config = if sel % 2 == 0 {
        Config::from_toml(text, &Cli::default())
    } else {
        let Some(cli) = worker_flags(text.lines()) else { return };
        Config::from_toml("", &cli)
    };
    let Ok(config) = config else { return };
    assert!(config.block_size >= 1 && config.log_max_blocks >= 1 && config.snapshot_page_blocks >= 1);
    assert!(config.max_pending_batches >= 1 && !config.health_interval.is_zero() && !config.replay_timeout.is_zero());
    assert!((100..=60_000).contains(&config.peer_load_ttl.as_millis()), "{:?}", config.peer_load_ttl);
    if let Some(x) = &config.load_exchange {
        let Transport::Nats(n) = &config.transport else { panic!("a load exchange without NATS") };
        let under = |p: &str| x.subject == p || x.subject.starts_with(&format!("{p}."));
        assert!(!under(&n.subject_prefix) && !x.subject.contains(['*', '>', ' ']), "{x:?}");
    }
    match config.discovery {
        Discovery::Static => assert!((1..=MAX_WORKERS).contains(&config.workers.len())),
        _ => assert!(config.workers.is_empty(), "workers and a discovery backend"),
    }
    for (i, w) in config.workers.iter().enumerate() {
        assert!(w.id.len() <= 255 && w.id.parse::<SocketAddr>().is_ok(), "worker id {:?}", w.id);
        assert!(!config.workers[..i].iter().any(|o| o.id == w.id), "worker {} twice", w.id);
        for ep in std::iter::once(&w.events).chain(&w.replay) {
            assert!(ep.starts_with("tcp://") || ep.starts_with("ipc://"), "endpoint {ep:?}");
        }
        assert!((1..=64).contains(&w.dp_ranks));
        if sel % 2 == 1 {
            let again = worker_flags(std::iter::once(canonical(w).as_str()))
                .map(|cli| Config::from_toml("", &cli).map(|c| c.workers));
            assert_eq!(again, Some(Ok(vec![w.clone()])), "--worker {} does not round-trip", canonical(w));
        }
    }
}

/// The flags parsed as the binary parses its command line; `None` if clap refuses them.
fn worker_flags<'a>(specs: impl Iterator<Item = &'a str>) -> Option<Cli> {
    let mut args = vec!["kvroute-sidecar".to_string()];
    for s in specs {
        args.push(format!("--worker={s}"));
    }
    Cli::try_parse_from(args).ok()
}

fn canonical(w: &WorkerConfig) -> String {
    let mut s = format!("{}={}", w.id, w.events);
    if let Some(r) = &w.replay {
        s += &format!(",replay={r}");
    }
    let role = match w.role {
        Role::Both => "both",
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    };
    s + &format!(",role={role},dp={}", w.dp_ranks)
}
