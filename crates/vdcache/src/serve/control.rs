//! The control socket of a running server: one JSON request per line,
//! one JSON reply per line. `vdcache stats` and `vdcache flush` are its
//! clients. The socket is created with mode 0600 (owner only).

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use vdcache_ownership::OwnedSocket;

/// What a client asks.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "cmd", rename_all = "kebab-case")]
pub enum Request {
    Stats,
    /// Write every dirty block back to the images (and fill partially
    /// valid clusters first when `fill`).
    Flush {
        #[serde(default)]
        fill: bool,
    },
    /// Change an export's share of the cache at run time (absent keys
    /// keep their value); answers the share now in force.
    Share {
        export: String,
        #[serde(default)]
        min: Option<String>,
        #[serde(default)]
        max: Option<String>,
        #[serde(default)]
        weight: Option<f64>,
    },
}

/// What the server answers.
#[derive(Debug, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub data: serde_json::Value,
}

/// Answers requests; implemented by the server.
pub trait Handler: Send + Sync {
    fn handle(&self, req: &Request) -> Result<serde_json::Value>;
}

/// A listening control socket and its thread.
pub struct ControlServer {
    /// Removed after the thread ends, if still the socket bound here.
    socket: Option<OwnedSocket>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ControlServer {
    pub fn start(path: &Path, handler: Arc<dyn Handler>) -> Result<ControlServer> {
        let (listener, socket) = OwnedSocket::bind(path).context("control socket")?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("vdcache-control".into())
            .spawn(move || serve(listener, handler, s))?;
        Ok(ControlServer {
            socket: Some(socket),
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        drop(self.socket.take());
    }
}

fn serve(listener: UnixListener, handler: Arc<dyn Handler>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let h = handler.clone();
                // One short-lived thread per client: requests may take long
                // (a flush writes everything back).
                let _ = std::thread::Builder::new()
                    .name("vdcache-control-client".into())
                    .spawn(move || answer(stream, &*h));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(e) => {
                tracing::warn!("control socket accept failed: {e}");
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        }
    }
}

fn answer(stream: UnixStream, handler: &dyn Handler) {
    let _ = stream.set_nonblocking(false);
    let mut reader = BufReader::new(match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    });
    let mut writer = stream;
    let mut line = String::new();
    // Bounded: a request is a short JSON object.
    while reader
        .by_ref()
        .take(64 * 1024)
        .read_line(&mut line)
        .unwrap_or(0)
        > 0
    {
        let reply = match serde_json::from_str::<Request>(line.trim()) {
            Ok(req) => match handler.handle(&req) {
                Ok(data) => Reply {
                    ok: true,
                    error: None,
                    data,
                },
                Err(e) => Reply {
                    ok: false,
                    error: Some(format!("{e:#}")),
                    data: serde_json::Value::Null,
                },
            },
            Err(e) => Reply {
                ok: false,
                error: Some(format!("bad request: {e}")),
                data: serde_json::Value::Null,
            },
        };
        let Ok(mut text) = serde_json::to_string(&reply) else {
            return;
        };
        text.push('\n');
        if writer.write_all(text.as_bytes()).is_err() {
            return;
        }
        line.clear();
    }
}

/// Sends one request to a running server and returns its data, giving up
/// when no reply came within `timeout` (None: waits as long as it takes).
pub fn request(
    path: &Path,
    req: &Request,
    timeout: Option<std::time::Duration>,
) -> Result<serde_json::Value> {
    let mut stream = UnixStream::connect(path).with_context(|| {
        format!(
            "cannot reach a vdcache server at {} (is it running?)",
            path.display()
        )
    })?;
    stream.set_read_timeout(timeout)?;
    stream.set_write_timeout(timeout)?;
    let unanswered = |e: std::io::Error| -> anyhow::Error {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => anyhow::anyhow!(
                "the vdcache server at {} did not answer within {:.0} s (stopped, or hung?); \
                 --timeout 0 waits as long as it takes",
                path.display(),
                timeout.unwrap_or_default().as_secs_f64()
            ),
            _ => anyhow::Error::new(e).context(format!(
                "the vdcache server at {} closed the connection before answering (did it stop?)",
                path.display()
            )),
        }
    };
    let mut text = serde_json::to_string(req)?;
    text.push('\n');
    stream.write_all(text.as_bytes()).map_err(unanswered)?;
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .map_err(unanswered)?;
    if line.is_empty() {
        bail!(
            "the vdcache server at {} closed the connection before answering (did it stop?)",
            path.display()
        );
    }
    let reply: Reply =
        serde_json::from_str(&line).context("the server sent an unreadable reply")?;
    if !reply.ok {
        bail!("{}", reply.error.unwrap_or_else(|| "request failed".into()));
    }
    Ok(reply.data)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo;
    impl Handler for Echo {
        fn handle(&self, req: &Request) -> Result<serde_json::Value> {
            match req {
                Request::Stats => Ok(serde_json::json!({"reads": 7})),
                Request::Flush { .. } => bail!("nothing to flush"),
                Request::Share { export, .. } => Ok(serde_json::json!({"export": export})),
            }
        }
    }

    #[test]
    fn requests_round_trip_and_errors_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctl.sock");
        let _server = ControlServer::start(&path, Arc::new(Echo)).unwrap();
        assert_eq!(request(&path, &Request::Stats, None).unwrap()["reads"], 7);
        let err = request(&path, &Request::Flush { fill: false }, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("nothing to flush"), "{err}");
        let share = Request::Share {
            export: "vm1".into(),
            min: Some("1G".into()),
            max: None,
            weight: Some(2.0),
        };
        assert_eq!(request(&path, &share, None).unwrap()["export"], "vm1");
        assert!(ControlServer::start(&path, Arc::new(Echo)).is_err());
    }
}
