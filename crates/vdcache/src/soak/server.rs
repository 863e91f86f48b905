//! The `vdcache serve` child process of a soak: started with its output
//! appended to one log, ready once its socket accepts connections (polled,
//! bounded), killed with SIGKILL or stopped with SIGTERM.
//!
//! Owns the child's lifetime: a server that is dropped is killed and
//! reaped, so no failure path leaves one behind. Must not interpret what
//! the server serves.

use anyhow::{Context, Result, bail};
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a start or a clean stop may take.
const DEADLINE: Duration = Duration::from_secs(300);

/// How to start the server.
pub struct ServerSpec {
    pub vdcache: PathBuf,
    /// Everything after the program name.
    pub args: Vec<OsString>,
    pub socket: PathBuf,
    pub log: PathBuf,
}

/// A running server.
pub struct Server {
    child: Option<Child>,
    log: PathBuf,
}

/// The end of a log, for error messages.
pub fn log_tail(log: &Path) -> String {
    let Ok(mut f) = File::open(log) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(4000)));
    let mut v = Vec::new();
    let _ = f.read_to_end(&mut v);
    String::from_utf8_lossy(&v).into_owned()
}

impl ServerSpec {
    /// The command line, for reports.
    pub fn command_line(&self) -> String {
        let mut s = self.vdcache.display().to_string();
        for a in &self.args {
            s.push(' ');
            s.push_str(&a.to_string_lossy());
        }
        s
    }

    /// Starts a server, writing `label` into the log first.
    pub fn spawn(&self, label: &str) -> Result<Server> {
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("cannot open {}", self.log.display()))?;
        writeln!(log, "=== soak: {label} ===")?;
        let err = log.try_clone()?;
        let child = Command::new(&self.vdcache)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .with_context(|| format!("cannot run {}", self.vdcache.display()))?;
        Ok(Server {
            child: Some(child),
            log: self.log.clone(),
        })
    }

    /// Starts a server and waits until it accepts connections.
    pub fn start(&self, label: &str) -> Result<Server> {
        let mut s = self.spawn(label)?;
        s.wait_ready(&self.socket)?;
        Ok(s)
    }
}

impl Server {
    /// Has it exited on its own? (Reaps it if so.)
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    fn died(&self, what: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "{what}; end of the server log {}:\n{}",
            self.log.display(),
            log_tail(&self.log)
        )
    }

    pub fn wait_ready(&mut self, socket: &Path) -> Result<()> {
        let start = Instant::now();
        loop {
            if let Some(st) = self.exited() {
                self.child = None;
                return Err(self.died(&format!("the server exited ({st}) before listening")));
            }
            if UnixStream::connect(socket).is_ok() {
                return Ok(());
            }
            if start.elapsed() > DEADLINE {
                return Err(self.died(&format!(
                    "the server did not listen on {} within {DEADLINE:?}",
                    socket.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// SIGKILL, then reaps it.
    pub fn kill9(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill().context("SIGKILL")?;
            c.wait().context("reaping the killed server")?;
        }
        Ok(())
    }

    /// SIGTERM and waits for a clean exit (status 0).
    pub fn terminate(mut self) -> Result<()> {
        let Some(pid) = self.child.as_ref().map(|c| c.id()) else {
            bail!("the server is not running");
        };
        let st = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .context("running kill -TERM")?;
        if !st.success() {
            bail!("kill -TERM {pid} failed ({st})");
        }
        let start = Instant::now();
        loop {
            if let Some(st) = self.exited() {
                self.child = None;
                if !st.success() {
                    return Err(self.died(&format!("the server stopped with {st} on SIGTERM")));
                }
                return Ok(());
            }
            if start.elapsed() > DEADLINE {
                return Err(self.died(&format!(
                    "the server did not stop within {DEADLINE:?} of SIGTERM"
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.kill9();
    }
}
