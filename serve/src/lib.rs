//! What kvroute's native services (the sidecar, the tokenizer stage, the fleet's mock
//! engine) share, written once: serving HTTP/1.1 on a listener, stopping on Ctrl-C or
//! SIGTERM, whole responses, reading a TOML configuration file into its typed form, locking
//! shared state, the wall clock.

use hyper::body::{Body, Incoming};
use hyper::{Request, Response};
use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

/// Serves HTTP/1.1 on every connection `listener` accepts, `handle` answering each
/// request; runs until dropped. TCP_NODELAY is set: responses are small and written in
/// pieces, which Nagle would hold back for the peer's delayed ACK (~40 ms). An accept error
/// (out of file descriptors and the like) is logged and retried after a pause.
pub async fn serve_http1<H, F, B>(listener: tokio::net::TcpListener, handle: H)
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + 'static,
    F: Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                log::error!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let handle = handle.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(handle);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await
            {
                log::debug!("connection: {e}");
            }
        });
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        if let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            tokio::select! {
                _ = ctrl_c => {},
                _ = term.recv() => {},
            }
            return;
        }
    }
    let _ = ctrl_c.await;
}

/// TOML text parsed into `T`; the error is the parser's, which names the key and line.
pub fn parse_toml<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, String> {
    toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())
}

/// The TOML file given as `--config path`, parsed into `T`; with no `--config`, `T`'s
/// defaults (every setting then comes from flags or is defaulted).
pub fn read_toml<T: serde::de::DeserializeOwned + Default>(path: Option<&str>) -> Result<T, String> {
    let Some(path) = path else { return Ok(T::default()) };
    let text = std::fs::read_to_string(path).map_err(|e| format!("--config {path}: {e}"))?;
    parse_toml(&text).map_err(|e| format!("{path}: {e}"))
}

/// Wall-clock seconds since the Unix epoch (0 if the clock is before it), as engines stamp
/// their event batches.
pub fn unix_seconds() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// A whole response: `status`, a `content-type` and the body.
pub fn respond(
    status: hyper::StatusCode,
    content_type: &str,
    body: impl Into<bytes::Bytes>,
) -> Response<http_body_util::Full<bytes::Bytes>> {
    let mut r = Response::new(http_body_util::Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

/// Locks `m`, also after a thread panicked holding it: every value these services keep
/// under a lock is consistent between statements (a panic cannot leave half an update),
/// so serving on is better than failing every later request.
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug, Default, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Settings {
        listen: String,
    }

    #[test]
    fn toml_errors_name_the_file_and_the_key() {
        assert_eq!(parse_toml::<Settings>("listen = \"a\"").unwrap(), Settings { listen: "a".into() });
        assert!(parse_toml::<Settings>("lisen = \"a\"").unwrap_err().contains("lisen"));
        let dir = std::env::temp_dir().join(format!("kvroute-serve-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.toml");
        std::fs::write(&path, "listen = 1").unwrap();
        let p = path.to_str().unwrap();
        let e = read_toml::<Settings>(Some(p)).unwrap_err();
        assert!(e.starts_with(&format!("{p}: ")) && e.contains("listen"), "{e}");
        assert_eq!(read_toml::<Settings>(None).unwrap(), Settings::default());
        assert!(read_toml::<Settings>(Some("/nonexistent/x.toml"))
            .unwrap_err()
            .starts_with("--config /nonexistent/x.toml: "));
        let _ = std::fs::remove_dir_all(dir);
    }
}
