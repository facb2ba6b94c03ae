//! The part of Envoy's external processing protocol this stage speaks, declared here from
//! its documented definitions (`envoy/service/ext_proc/v3/external_processor.proto`,
//! `envoy/config/core/v3/base.proto`, `envoy/extensions/filters/http/ext_proc/v3/
//! processing_mode.proto`, Envoy 1.40): the same field numbers and types, so the wire is
//! Envoy's. Fields this stage neither reads nor writes are left out; protobuf skips them.

/// `envoy.service.ext_proc.v3.ProcessingRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingRequest {
    #[prost(oneof = "processing_request::Request", tags = "2, 3, 4, 5, 6, 7")]
    pub request: Option<processing_request::Request>,
    #[prost(bool, tag = "10")]
    pub observability_mode: bool,
    /// How Envoy sends this stream's bodies; on the first message only.
    #[prost(message, optional, tag = "11")]
    pub protocol_config: Option<ProtocolConfiguration>,
}

/// `envoy.service.ext_proc.v3.ProtocolConfiguration`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProtocolConfiguration {
    #[prost(enumeration = "BodySendMode", tag = "1")]
    pub request_body_mode: i32,
    #[prost(enumeration = "BodySendMode", tag = "2")]
    pub response_body_mode: i32,
    #[prost(bool, tag = "3")]
    pub send_body_without_waiting_for_header_response: bool,
}

pub mod processing_request {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Request {
        #[prost(message, tag = "2")]
        RequestHeaders(super::HttpHeaders),
        #[prost(message, tag = "3")]
        ResponseHeaders(super::HttpHeaders),
        #[prost(message, tag = "4")]
        RequestBody(super::HttpBody),
        #[prost(message, tag = "5")]
        ResponseBody(super::HttpBody),
        #[prost(message, tag = "6")]
        RequestTrailers(super::HttpTrailers),
        #[prost(message, tag = "7")]
        ResponseTrailers(super::HttpTrailers),
    }
}

/// `envoy.service.ext_proc.v3.ProcessingResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingResponse {
    #[prost(oneof = "processing_response::Response", tags = "1, 2, 3, 4, 5, 6")]
    pub response: Option<processing_response::Response>,
    #[prost(message, optional, tag = "9")]
    pub mode_override: Option<ProcessingMode>,
}

pub mod processing_response {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Response {
        #[prost(message, tag = "1")]
        RequestHeaders(super::HeadersResponse),
        #[prost(message, tag = "2")]
        ResponseHeaders(super::HeadersResponse),
        #[prost(message, tag = "3")]
        RequestBody(super::BodyResponse),
        #[prost(message, tag = "4")]
        ResponseBody(super::BodyResponse),
        #[prost(message, tag = "5")]
        RequestTrailers(super::TrailersResponse),
        #[prost(message, tag = "6")]
        ResponseTrailers(super::TrailersResponse),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpHeaders {
    #[prost(message, optional, tag = "1")]
    pub headers: Option<HeaderMap>,
    #[prost(bool, tag = "3")]
    pub end_of_stream: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpBody {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: bytes::Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpTrailers {
    #[prost(message, optional, tag = "1")]
    pub trailers: Option<HeaderMap>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeadersResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct BodyResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TrailersResponse {
    #[prost(message, optional, tag = "1")]
    pub header_mutation: Option<HeaderMutation>,
}

/// `CommonResponse`; `status` 0 is `CONTINUE`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CommonResponse {
    #[prost(int32, tag = "1")]
    pub status: i32,
    #[prost(message, optional, tag = "2")]
    pub header_mutation: Option<HeaderMutation>,
    #[prost(bool, tag = "5")]
    pub clear_route_cache: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMutation {
    #[prost(message, repeated, tag = "1")]
    pub set_headers: Vec<HeaderValueOption>,
    #[prost(string, repeated, tag = "2")]
    pub remove_headers: Vec<String>,
}

/// `envoy.config.core.v3.HeaderMap`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMap {
    #[prost(message, repeated, tag = "1")]
    pub headers: Vec<HeaderValue>,
}

/// `envoy.config.core.v3.HeaderValue`. Envoy sends values in `raw_value`, and reads either.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
    #[prost(bytes = "vec", tag = "3")]
    pub raw_value: Vec<u8>,
}

impl HeaderValue {
    /// The value, whichever field carries it.
    pub fn bytes(&self) -> &[u8] {
        if self.raw_value.is_empty() {
            self.value.as_bytes()
        } else {
            &self.raw_value
        }
    }
}

/// `envoy.config.core.v3.HeaderValueOption`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValueOption {
    #[prost(message, optional, tag = "1")]
    pub header: Option<HeaderValue>,
    #[prost(enumeration = "HeaderAppendAction", tag = "3")]
    pub append_action: i32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum HeaderAppendAction {
    AppendIfExistsOrAdd = 0,
    AddIfAbsent = 1,
    OverwriteIfExistsOrAdd = 2,
    OverwriteIfExists = 3,
}

/// `envoy.extensions.filters.http.ext_proc.v3.ProcessingMode`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingMode {
    #[prost(enumeration = "HeaderSendMode", tag = "1")]
    pub request_header_mode: i32,
    #[prost(enumeration = "HeaderSendMode", tag = "2")]
    pub response_header_mode: i32,
    #[prost(enumeration = "BodySendMode", tag = "3")]
    pub request_body_mode: i32,
    #[prost(enumeration = "BodySendMode", tag = "4")]
    pub response_body_mode: i32,
    #[prost(enumeration = "HeaderSendMode", tag = "5")]
    pub request_trailer_mode: i32,
    #[prost(enumeration = "HeaderSendMode", tag = "6")]
    pub response_trailer_mode: i32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum HeaderSendMode {
    Default = 0,
    Send = 1,
    Skip = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum BodySendMode {
    None = 0,
    Streamed = 1,
    Buffered = 2,
    BufferedPartial = 3,
    FullDuplexStreamed = 4,
}
