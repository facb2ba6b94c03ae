//! Envoy's `workers` cluster from the fleet: endpoint discovery (EDS, xDS v3) over
//! REST-JSON. Envoy polls `POST /v3/discovery:endpoints` every `refresh_delay` with a
//! `DiscoveryRequest` naming its cluster; the answer is one `ClusterLoadAssignment` per name,
//! listing every worker of the fleet (up: `HEALTHY`, down: `UNHEALTHY`), so the hosts Envoy
//! routes to and the workers the filter scores come from the same list.
//!
//! REST rather than gRPC: the sidecar already serves HTTP/1 JSON, Envoy's REST transport
//! carries the same resources, and a poll every 0.5 s per gateway is cheap next to the feed's
//! long poll. A gRPC stream would push a change sooner than the next poll, at the cost of
//! an HTTP/2 gRPC server and Envoy's protos in the sidecar (`envoy/README.md`).

use crate::fleet::Fleet;
use serde::Deserialize;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;

pub const EDS_PATH: &str = "/v3/discovery:endpoints";
pub const TYPE_URL: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
/// A discovery request is a node description and a few names; anything larger is refused.
/// The node lists every extension the Envoy binary has: 77 KB from Envoy 1.40's 516.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;
/// Clusters one request may name.
const MAX_NAMES: usize = 64;

/// The parts of Envoy's `DiscoveryRequest` the answer depends on (the rest, such as
/// `node`, is ignored). Envoy 1.40 sends the proto's field names (`resource_names`);
/// protobuf's JSON mapping also allows lowerCamelCase (`resourceNames`), accepted too.
#[derive(Deserialize, Debug, Default)]
struct DiscoveryRequest {
    #[serde(default, alias = "resourceNames")]
    resource_names: Vec<String>,
    #[serde(default, alias = "typeUrl")]
    type_url: String,
}

/// The `DiscoveryResponse` for a request body; Err: what is wrong with the request.
pub fn answer(fleet: &Fleet, body: &[u8]) -> Result<serde_json::Value, String> {
    let req: DiscoveryRequest =
        serde_json::from_slice(body).map_err(|e| format!("not a DiscoveryRequest in JSON: {e}"))?;
    if !req.type_url.is_empty() && req.type_url != TYPE_URL {
        return Err(format!("type_url `{}`: only endpoints ({TYPE_URL}) are served", req.type_url));
    }
    if req.resource_names.is_empty() {
        return Err("resource_names: name the cluster (eds_cluster_config.service_name)".into());
    }
    if req.resource_names.len() > MAX_NAMES {
        return Err(format!("resource_names: {} names, at most {MAX_NAMES}", req.resource_names.len()));
    }
    let endpoints = endpoints(fleet);
    // The version names the endpoint list: an unchanged fleet answers the same version.
    let mut h = std::hash::DefaultHasher::new();
    endpoints.to_string().hash(&mut h);
    let version = format!("{:016x}", h.finish());
    let resources: Vec<serde_json::Value> = req
        .resource_names
        .iter()
        .map(|name| {
            serde_json::json!({
                "@type": TYPE_URL,
                "cluster_name": name,
                "endpoints": [{"lb_endpoints": endpoints}],
            })
        })
        .collect();
    Ok(serde_json::json!({"version_info": version, "resources": resources, "type_url": TYPE_URL}))
}

/// Every worker as an `LbEndpoint`, in the fleet's order.
fn endpoints(fleet: &Fleet) -> serde_json::Value {
    fleet
        .workers
        .iter()
        .filter_map(|w| {
            // Ids are validated as ip:port when a worker joins.
            let addr: SocketAddr = w.config.id.parse().ok()?;
            Some(serde_json::json!({
                "endpoint": {"address": {"socket_address": {
                    "address": addr.ip().to_string(), "port_value": addr.port()}}},
                "health_status": if w.up { "HEALTHY" } else { "UNHEALTHY" },
            }))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Cli, Config};

    fn fleet() -> Fleet {
        let text = "[[workers]]\nid=\"127.0.0.1:8101\"\nevents=\"tcp://127.0.0.1:5557\"\n\
                    [[workers]]\nid=\"[fd00::5]:8000\"\nevents=\"tcp://[fd00::5]:5557\"";
        Fleet::new(&Config::from_toml(text, &Cli::default()).unwrap(), 7)
    }

    #[test]
    fn every_worker_is_an_endpoint_of_each_named_cluster() {
        let mut f = fleet();
        // As Envoy 1.40 sends it (trimmed: its node lists 516 extensions).
        let a = answer(&f, br#"{"node":{"id":"gw-1","cluster":"kvroute","user_agent_name":"envoy","extensions":[{"name":"envoy.filters.http.router"}]},"resource_names":["workers"],"type_url":"type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"}"#).unwrap();
        assert_eq!(a["type_url"], TYPE_URL);
        let cla = &a["resources"][0];
        assert_eq!((cla["@type"].as_str(), cla["cluster_name"].as_str()), (Some(TYPE_URL), Some("workers")));
        let eps = cla["endpoints"][0]["lb_endpoints"].as_array().unwrap();
        let addr = |i: usize| &eps[i]["endpoint"]["address"]["socket_address"];
        assert_eq!((addr(0)["address"].as_str(), addr(0)["port_value"].as_u64()), (Some("127.0.0.1"), Some(8101)));
        assert_eq!(addr(1)["address"].as_str(), Some("fd00::5"));
        assert_eq!(eps[1]["health_status"], "HEALTHY");
        // Same fleet, same version; a worker marked down changes both.
        // protobuf JSON's lowerCamelCase names mean the same.
        let again = answer(&f, br#"{"versionInfo":"1","resourceNames":["workers"]}"#).unwrap();
        assert_eq!(again["version_info"], a["version_info"]);
        f.set_up(1, false);
        let down = answer(&f, br#"{"resource_names":["workers"]}"#).unwrap();
        assert_ne!(down["version_info"], a["version_info"]);
        assert_eq!(down["resources"][0]["endpoints"][0]["lb_endpoints"][1]["health_status"], "UNHEALTHY");
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let f = fleet();
        for (body, says) in [
            (&b"not json"[..], "DiscoveryRequest"),
            (br#"{"resource_names":[]}"#, "name the cluster"),
            (
                br#"{"resource_names":["w"],"type_url":"type.googleapis.com/envoy.config.cluster.v3.Cluster"}"#,
                "only endpoints",
            ),
            (br#"{"resource_names":"workers"}"#, "DiscoveryRequest"),
        ] {
            assert!(answer(&f, body).unwrap_err().contains(says), "{body:?}");
        }
    }
}
