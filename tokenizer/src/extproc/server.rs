//! The gRPC side of ext_proc: `envoy.service.ext_proc.v3.ExternalProcessor/Process`, a
//! bidirectional stream per HTTP request, served with tonic. Each request message gets its
//! response, in order, from a [`StreamHandler`] that keeps what the stream has seen so far;
//! a handler may hold a message's response back and send it with a later one's (the
//! headers answered once the body they wait for is read).

use super::proto::{ProcessingRequest, ProcessingResponse};
use std::sync::Arc;
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic::{Request, Response, Status, Streaming};

/// Answers the messages of one HTTP request's stream, in order.
pub trait StreamHandler: Send + 'static {
    /// The responses `msg` lets go (none while it waits for more), in order; `None` ends the
    /// stream cleanly (Envoy then goes on without the stage).
    fn handle(&mut self, msg: ProcessingRequest) -> BoxFuture<Option<Vec<ProcessingResponse>>, Status>;
}

/// Makes one [`StreamHandler`] per gRPC stream (given the shared factory, which a handler
/// can keep).
pub trait HandlerFactory: Send + Sync + 'static {
    type Handler: StreamHandler;
    fn new_stream(self: Arc<Self>) -> Self::Handler;
}

/// The tonic service (what `tonic-build` would generate for the one method).
pub struct ExternalProcessorServer<F> {
    factory: Arc<F>,
    max_message_bytes: usize,
}

impl<F> Clone for ExternalProcessorServer<F> {
    fn clone(&self) -> Self {
        ExternalProcessorServer { factory: self.factory.clone(), max_message_bytes: self.max_message_bytes }
    }
}

impl<F: HandlerFactory> ExternalProcessorServer<F> {
    /// `max_message_bytes`: the largest message accepted (a buffered body arrives whole in
    /// one message).
    pub fn new(factory: Arc<F>, max_message_bytes: usize) -> Self {
        ExternalProcessorServer { factory, max_message_bytes }
    }
}

impl<F> NamedService for ExternalProcessorServer<F> {
    const NAME: &'static str = "envoy.service.ext_proc.v3.ExternalProcessor";
}

const PROCESS: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

struct Process<F>(Arc<F>);

impl<F: HandlerFactory> StreamingService<ProcessingRequest> for Process<F> {
    type Response = ProcessingResponse;
    type ResponseStream = tokio_stream::wrappers::ReceiverStream<Result<ProcessingResponse, Status>>;
    type Future = BoxFuture<Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: Request<Streaming<ProcessingRequest>>) -> Self::Future {
        let mut handler = self.0.clone().new_stream();
        Box::pin(async move {
            let mut incoming = request.into_inner();
            // Responses go out as they are made: a small buffer is enough.
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            tokio::spawn(async move {
                loop {
                    let msg = match incoming.message().await {
                        Ok(Some(m)) => m,
                        Ok(None) => return, // Envoy closed its side
                        Err(e) => {
                            log::debug!("ext_proc stream: {e}");
                            return;
                        }
                    };
                    let replies = match handler.handle(msg).await {
                        Ok(Some(replies)) => replies.into_iter().map(Ok).collect(),
                        Ok(None) => return,
                        Err(status) => vec![Err(status)],
                    };
                    let failed = replies.iter().any(Result::is_err);
                    for r in replies {
                        if tx.send(r).await.is_err() {
                            return;
                        }
                    }
                    if failed {
                        return;
                    }
                }
            });
            Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(rx)))
        })
    }
}

impl<F, B> Service<http::Request<B>> for ExternalProcessorServer<F>
where
    F: HandlerFactory,
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != PROCESS {
            let status = Status::unimplemented(format!("no method {}", req.uri().path()));
            return Box::pin(async move { Ok(status.into_http()) });
        }
        let svc = Process(self.factory.clone());
        let max = self.max_message_bytes;
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::<ProcessingResponse, ProcessingRequest>::default();
            let mut grpc = Grpc::new(codec).max_decoding_message_size(max).max_encoding_message_size(max);
            Ok(grpc.streaming(svc, req).await)
        })
    }
}
