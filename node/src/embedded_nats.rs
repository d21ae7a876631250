//! An embedded `nats-server -js` child process with its own data directory,
//! on a free loopback port. Killed (and its directory removed) on drop.
//!
//! The server runs in a process group of its own, so a terminal's Ctrl-C
//! (SIGINT to the node's whole group) reaches the node only: the node
//! drains and deregisters over a bus that is still up, and stops the
//! server last.

use std::net::TcpListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::process::{Child, Command};

#[derive(Debug, Error)]
pub enum NatsError {
    #[error("cannot start nats-server (is it installed? `make deps`): {0}")]
    Spawn(std::io::Error),
    #[error("cannot find a free port: {0}")]
    Port(std::io::Error),
    #[error("cannot create the NATS data directory: {0}")]
    DataDir(std::io::Error),
    #[error("nats-server did not accept connections on port {port} within {waited:?}; see {log}")]
    NotReady {
        port: u16,
        waited: Duration,
        log: String,
    },
}

pub struct EmbeddedNats {
    child: Child,
    pub url: String,
    _dir: tempfile::TempDir,
    pub log: PathBuf,
}

pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl EmbeddedNats {
    pub async fn start(port: u16) -> Result<Self, NatsError> {
        let port = if port == 0 {
            free_port().map_err(NatsError::Port)?
        } else {
            port
        };
        let dir = tempfile::Builder::new()
            .prefix("dynamo-nats-")
            .tempdir()
            .map_err(NatsError::DataDir)?;
        let log = dir.path().join("nats.log");
        let mut cmd = Command::new("nats-server");
        // SAFETY: prctl is async-signal-safe; it only asks the kernel to
        // stop the server if the node dies without stopping it (kill -9),
        // since its own process group keeps the terminal's signals away.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = cmd
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(dir.path().join("js"))
            .arg("-l")
            .arg(&log)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            // Shielded from the terminal's signals: the node stops it last.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(NatsError::Spawn)?;
        let t0 = Instant::now();
        let waited = Duration::from_secs(15);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if t0.elapsed() > waited {
                return Err(NatsError::NotReady {
                    port,
                    waited,
                    log: log.display().to_string(),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(EmbeddedNats {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            _dir: dir,
            log,
        })
    }

    /// Stops the server and waits for it to exit.
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            // SIGTERM lets it flush; fall back to SIGKILL.
            unsafe {
                libc::kill(pid as i32, libc::SIGTERM);
            }
            if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
                .await
                .is_ok()
            {
                return;
            }
        }
        let _ = self.child.kill().await;
    }
}
