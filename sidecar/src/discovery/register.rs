//! `kvroute-sidecar register`: runs beside one engine and keeps its [`Registration`] in etcd
//! under a lease, the engine side of `discovery_backend = "etcd"`. The key is
//! `{prefix}{http}`; the lease is kept alive every `ttl / 3`. If etcd loses the lease (an
//! outage longer than the TTL) the registrar registers again; SIGTERM or SIGINT revoke the
//! lease, so a worker that is shut down leaves every sidecar's fleet at once, and one that
//! dies leaves when its lease ends.

use super::Registration;
use crate::config::DEFAULT_ETCD_PREFIX;
use etcd_client::{Client, PutOptions};
use std::time::Duration;

#[derive(clap::Args, Debug, Clone)]
pub struct RegisterArgs {
    /// etcd client endpoint (`http://host:2379`). Repeatable.
    #[arg(long = "etcd-endpoint", required = true)]
    pub etcd_endpoints: Vec<String>,
    /// Key prefix the sidecars watch.
    #[arg(long, default_value = DEFAULT_ETCD_PREFIX)]
    pub etcd_prefix: String,
    /// The engine's `ip:port`, as Envoy routes to it.
    #[arg(long)]
    pub http: String,
    /// The engine's KV-event publisher (DP rank 0), e.g. `tcp://10.0.0.5:5557`.
    #[arg(long)]
    pub events: String,
    /// The engine's replay endpoint, if it has one.
    #[arg(long)]
    pub replay: Option<String>,
    /// both, prefill or decode.
    #[arg(long, default_value = "both")]
    pub role: String,
    #[arg(long, default_value_t = 1)]
    pub dp_ranks: u32,
    /// The model the engine serves.
    #[arg(long)]
    pub model: Option<String>,
    /// Lease time-to-live in seconds: how long a worker that died stays registered.
    #[arg(long, default_value_t = 5)]
    pub ttl: i64,
}

impl RegisterArgs {
    fn registration(&self) -> Registration {
        Registration {
            http: self.http.clone(),
            events: self.events.clone(),
            replay: self.replay.clone(),
            role: Some(self.role.clone()),
            dp_ranks: Some(self.dp_ranks),
            model: self.model.clone(),
        }
    }

    /// Everything a sidecar would refuse, refused here first.
    fn validate(&self) -> Result<(), String> {
        self.registration().worker("register")?;
        if !(2..=3600).contains(&self.ttl) {
            return Err(format!("--ttl: {} is not in 2..=3600 seconds", self.ttl));
        }
        if self.etcd_prefix.is_empty() {
            return Err("--etcd-prefix: must not be empty".into());
        }
        Ok(())
    }
}

/// The command: exit status 0 after a clean stop, 2 for bad arguments.
pub fn main(args: RegisterArgs) -> i32 {
    if let Err(e) = args.validate() {
        eprintln!("kvroute-sidecar register: {e}");
        return 2;
    }
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-sidecar register: tokio runtime: {e}");
            return 1;
        }
    };
    rt.block_on(async {
        let mut lease = None;
        tokio::select! {
            _ = keep_registered(&args, &mut lease) => {}
            _ = kvroute_serve::shutdown_signal() => {}
        }
        if let Some(id) = lease {
            revoke(&args, id).await;
        }
    });
    0
}

/// Registers, keeps the lease alive, and registers again whenever that fails; `lease` is
/// the lease in force, for the revoke at shutdown.
async fn keep_registered(args: &RegisterArgs, lease: &mut Option<i64>) {
    let key = format!("{}{}", args.etcd_prefix, args.http);
    let value = serde_json::to_string(&args.registration()).unwrap_or_default();
    let mut backoff = Duration::from_millis(200);
    loop {
        match session(args, &key, &value, lease).await {
            Ok(()) => log::warn!("{key}: etcd ended the lease; registering again"),
            Err(e) => log::warn!("{key}: {e}; retrying in {backoff:?}"),
        }
        *lease = None;
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// One lease: grant, put, keep alive until the lease is gone (Ok) or etcd fails (Err).
async fn session(args: &RegisterArgs, key: &str, value: &str, lease: &mut Option<i64>) -> Result<(), String> {
    let mut client = Client::connect(&args.etcd_endpoints, Some(super::etcd::connect_options()))
        .await
        .map_err(|e| format!("connecting: {e}"))?;
    let granted = client.lease_grant(args.ttl, None).await.map_err(|e| format!("lease grant: {e}"))?;
    let id = granted.id();
    *lease = Some(id);
    client.put(key, value, Some(PutOptions::new().with_lease(id))).await.map_err(|e| format!("put: {e}"))?;
    log::info!("registered {key} (lease {id:x}, ttl {} s)", granted.ttl());
    let (mut keeper, mut answers) = client.lease_keep_alive(id).await.map_err(|e| format!("keepalive: {e}"))?;
    let every = Duration::from_millis((args.ttl as u64 * 1000 / 3).max(500));
    loop {
        tokio::time::sleep(every).await;
        keeper.keep_alive().await.map_err(|e| format!("keepalive: {e}"))?;
        match answers.message().await.map_err(|e| format!("keepalive: {e}"))? {
            Some(a) if a.ttl() > 0 => {}
            _ => return Ok(()),
        }
    }
}

async fn revoke(args: &RegisterArgs, id: i64) {
    let attempt = async {
        let mut client = Client::connect(&args.etcd_endpoints, Some(super::etcd::connect_options())).await?;
        client.lease_revoke(id).await
    };
    match tokio::time::timeout(Duration::from_secs(3), attempt).await {
        Ok(Ok(_)) => log::info!("{}{}: deregistered", args.etcd_prefix, args.http),
        Ok(Err(e)) => log::warn!("revoking lease {id:x}: {e}; the key goes when the lease ends"),
        Err(_) => log::warn!("revoking lease {id:x}: timed out; the key goes when the lease ends"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn arguments_are_validated_before_anything_is_registered() {
        let cli = crate::config::Cli::try_parse_from([
            "kvroute-sidecar",
            "register",
            "--etcd-endpoint",
            "http://127.0.0.1:2379",
            "--http",
            "10.0.0.5:8000",
            "--events",
            "tcp://10.0.0.5:5557",
        ])
        .unwrap();
        let Some(crate::config::Command::Register(args)) = cli.command else { panic!("no subcommand") };
        assert!(args.validate().is_ok());
        assert_eq!((args.etcd_prefix.as_str(), args.ttl, args.dp_ranks), (DEFAULT_ETCD_PREFIX, 5, 1));
        let bad = RegisterArgs { http: "not-an-address".into(), ..args.clone() };
        assert!(bad.validate().unwrap_err().contains("register.id"));
        let bad = RegisterArgs { ttl: 1, ..args };
        assert!(bad.validate().unwrap_err().contains("--ttl"));
    }
}
