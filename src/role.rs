//! A worker's role in a prefill/decode (PD) disaggregated fleet: what the sidecar's
//! configuration names, the feed carries and the worker table records.

/// What a worker does in a prefill/decode (PD) disaggregated fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Both = 0,
    Prefill = 1,
    Decode = 2,
}

impl Role {
    pub fn from_u8(v: u8) -> Option<Role> {
        match v {
            0 => Some(Role::Both),
            1 => Some(Role::Prefill),
            2 => Some(Role::Decode),
            _ => None,
        }
    }
    pub fn can_prefill(self) -> bool {
        matches!(self, Role::Both | Role::Prefill)
    }
    pub fn can_decode(self) -> bool {
        matches!(self, Role::Both | Role::Decode)
    }
}
