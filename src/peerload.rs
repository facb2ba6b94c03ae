//! Load shared between gateway replicas. Each Envoy counts only the requests it routed
//! (`kvroute.slotload`); with several replicas in front of one fleet each would see part of
//! every engine's queue. So each sync service reports its gateway's per-worker load to its
//! sidecar ([`Report`], `POST /v1/load`), the sidecars exchange the reports, and the answer
//! ([`Answer`]) is the sum of every *other* gateway's load, which the sync service writes
//! as [`PeerLoad`] by its own slots and the filter adds to its own.
//!
//! Workers are named by id on the wire: two gateways number their slots apart.

use crate::layout::{decode_slot_records, encode_slot_records, LoadVector, WorkerSlot, MAX_SLOTS};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The other gateways' load per slot (written by the sync service with a plain set; read
/// by the filter while the table's `peer_load` flag is set).
pub const PEERLOAD_KEY: &str = "kvroute.peerload";

/// Longest gateway id accepted.
pub const MAX_GATEWAY_ID: usize = 128;

/// One worker's load as a gateway counts it: distinct prompt blocks in flight there and
/// uncached blocks whose prefill has not answered yet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerLoad {
    pub active: u32,
    pub prefill: u32,
}

impl WorkerLoad {
    pub fn is_zero(&self) -> bool {
        self.active == 0 && self.prefill == 0
    }
    /// Both counts summed, saturating.
    pub fn add(&mut self, other: WorkerLoad) {
        self.active = self.active.saturating_add(other.active);
        self.prefill = self.prefill.saturating_add(other.prefill);
    }
}

/// A gateway's report of its own load: only the workers with some.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    pub gateway: String,
    pub workers: BTreeMap<String, WorkerLoad>,
}

impl Report {
    /// The load vector as of prefill epoch `epoch`, by the worker ids of the table's slots.
    pub fn of(gateway: &str, slots: &[WorkerSlot], load: &LoadVector, epoch: u32) -> Report {
        let workers = slots
            .iter()
            .enumerate()
            .map(|(slot, s)| {
                (s.id.clone(), WorkerLoad { active: load.get(slot), prefill: load.pending_prefill(slot, epoch) })
            })
            .filter(|(_, l)| !l.is_zero())
            .collect();
        Report { gateway: gateway.to_string(), workers }
    }

    /// Checks what a reader must not trust: the gateway id, the worker count.
    pub fn validate(&self) -> Result<(), String> {
        if self.gateway.is_empty() || self.gateway.len() > MAX_GATEWAY_ID {
            return Err(format!("`gateway` must be 1 to {MAX_GATEWAY_ID} bytes"));
        }
        if self.workers.len() > MAX_SLOTS {
            return Err(format!("{} workers: at most {MAX_SLOTS}", self.workers.len()));
        }
        Ok(())
    }

    pub fn decode(bytes: &[u8]) -> Result<Report, String> {
        let r: Report = serde_json::from_slice(bytes).map_err(|e| format!("load report: {e}"))?;
        r.validate()?;
        Ok(r)
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// The sidecar's answer to a report: the other gateways' load summed per worker.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    /// Gateways whose reports are summed (fresh, not the asker's own).
    pub gateways: u32,
    pub workers: BTreeMap<String, WorkerLoad>,
}

impl Answer {
    pub fn decode(bytes: &[u8]) -> Result<Answer, String> {
        let a: Answer = serde_json::from_slice(bytes).map_err(|e| format!("load answer: {e}"))?;
        if a.workers.len() > MAX_SLOTS {
            return Err(format!("load answer: {} workers, at most {MAX_SLOTS}", a.workers.len()));
        }
        Ok(a)
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The answer by the table's slots; workers the table does not name are left out (the
    /// feed has not brought them here yet).
    pub fn by_slot(&self, slots: &[WorkerSlot]) -> PeerLoad {
        let mut load: Vec<WorkerLoad> =
            slots.iter().map(|s| self.workers.get(&s.id).copied().unwrap_or_default()).collect();
        while load.last().is_some_and(WorkerLoad::is_zero) {
            load.pop();
        }
        PeerLoad(load)
    }
}

/// [`PEERLOAD_KEY`]'s value: `n × { u32 active, u32 prefill }` per slot, little-endian.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerLoad(pub Vec<WorkerLoad>);

impl PeerLoad {
    pub fn decode(bytes: &[u8]) -> PeerLoad {
        PeerLoad(decode_slot_records(bytes, |[active, prefill]| WorkerLoad { active, prefill }))
    }
    pub fn encode(&self) -> Vec<u8> {
        encode_slot_records(&self.0, |l| [l.active, l.prefill])
    }
    pub fn get(&self, slot: usize) -> WorkerLoad {
        self.0.get(slot).copied().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{PrefillChange, SlotState};
    use crate::role::Role;

    fn table(ids: &[&str]) -> Vec<WorkerSlot> {
        ids.iter()
            .map(|id| WorkerSlot { id: id.to_string(), role: Role::Both, state: SlotState::Up, kv_capacity_blocks: 0 })
            .collect()
    }

    #[test]
    fn a_report_names_workers_by_id_and_leaves_idle_ones_out() {
        let t = table(&["a:1", "b:1", "c:1"]);
        let mut load = LoadVector::default();
        load.apply(&[(0, 40), (2, 7)]);
        load.apply_prefill(
            &[PrefillChange { slot: 2, epoch: 5, blocks: 3 }],
            5 * crate::layout::PREFILL_EPOCH_MS,
            false,
        );
        let r = Report::of("gw", &t, &load, 5);
        let want: BTreeMap<_, _> = [
            ("a:1".into(), WorkerLoad { active: 40, prefill: 0 }),
            ("c:1".into(), WorkerLoad { active: 7, prefill: 3 }),
        ]
        .into();
        assert_eq!(r.workers, want);
        assert_eq!(Report::decode(&r.encode()).unwrap(), r);
    }

    #[test]
    fn bad_reports_are_refused_with_the_reason() {
        assert!(Report::decode(b"{}").unwrap_err().contains("gateway"));
        assert!(Report::decode(br#"{"gateway":"","workers":{}}"#).unwrap_err().contains("gateway"));
        let long = format!(r#"{{"gateway":"{}","workers":{{}}}}"#, "g".repeat(MAX_GATEWAY_ID + 1));
        assert!(Report::decode(long.as_bytes()).unwrap_err().contains("gateway"));
        assert!(Report::decode(br#"{"gateway":"g","workers":{"a":{"active":-1,"prefill":0}}}"#).is_err());
        assert!(Report::decode(br#"{"gateway":"g","workers":{},"x":1}"#).is_err());
        assert!(Answer::decode(b"[1]").is_err());
    }

    #[test]
    fn an_answer_maps_to_this_gateways_slots() {
        let t = table(&["a:1", "b:1", "c:1"]);
        let a = Answer {
            gateways: 2,
            workers: [
                ("b:1".into(), WorkerLoad { active: 9, prefill: 4 }),
                ("zz:1".into(), WorkerLoad { active: 1, prefill: 1 }),
            ]
            .into(),
        };
        let p = a.by_slot(&t);
        assert_eq!(p.0, vec![WorkerLoad::default(), WorkerLoad { active: 9, prefill: 4 }]);
        assert_eq!(PeerLoad::decode(&p.encode()), p);
        assert_eq!(p.get(1).active, 9);
        assert_eq!(p.get(7), WorkerLoad::default());
        assert_eq!(Answer::decode(&a.encode()).unwrap(), a);
    }
}
