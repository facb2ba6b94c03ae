//! Envoy's external processing (ext_proc) protocol: the messages and the gRPC service.

pub mod handler;
pub mod proto;
pub mod server;
