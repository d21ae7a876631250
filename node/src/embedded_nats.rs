//! An embedded `nats-server -js` child process with its own data directory,
//! on a free loopback port. Killed (and its directory removed) on drop.
//!
//! Secure by default ([`Security`]): TLS with a CA and certificate made at
//! start (the CA's key is never kept), and one nkey user per role, each
//! allowed only its own subjects (`dynamo_bus_schema::access`). Its
//! configuration file, with the certificate's key, lives in its own
//! directory, owner-only.
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
    #[error("cannot write the NATS configuration: {0}")]
    Config(String),
    #[error("nats-server did not accept connections on port {port} within {waited:?}; its log ends:\n{log}")]
    NotReady {
        port: u16,
        waited: Duration,
        log: String,
    },
    #[error("nats-server exited at start ({status}); its log ends:\n{log}")]
    Exited { status: String, log: String },
}

pub struct EmbeddedNats {
    child: Child,
    pub url: String,
    _dir: tempfile::TempDir,
    pub log: PathBuf,
    /// The CA clients must trust (TLS on).
    pub ca_file: Option<PathBuf>,
}

/// How the embedded server is secured.
#[derive(Default)]
pub struct Security {
    /// TLS on, with certificates generated at start.
    pub tls: bool,
    /// The `accounts` block of its users (None: no users).
    pub accounts: Option<String>,
}

pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl EmbeddedNats {
    pub async fn start(port: u16, security: Security) -> Result<Self, NatsError> {
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
        let cfg_err = |e: &dyn std::fmt::Display| NatsError::Config(e.to_string());
        // One quoted string in the server's config syntax.
        let q = |p: &std::path::Path| format!("{:?}", p.display().to_string());
        let mut conf = format!(
            "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: {} }}\n",
            q(&dir.path().join("js"))
        );
        let mut ca_file = None;
        if security.tls {
            let pki = dynamo_runtime::tls::Pki::generate(
                "dynamo embedded NATS",
                &["127.0.0.1", "localhost"],
            )
            .map_err(|e| cfg_err(&e))?;
            let files = pki.write(dir.path()).map_err(|e| cfg_err(&e))?;
            conf.push_str(&format!(
                "tls {{ cert_file: {}, key_file: {}, timeout: 5 }}\n",
                q(&files.cert),
                q(&files.key)
            ));
            ca_file = Some(files.ca);
        }
        if let Some(auth) = &security.accounts {
            conf.push_str(auth);
        }
        let conf_path = dir.path().join("nats.conf");
        dynamo_runtime::tls::write_file(&conf_path, &conf, true).map_err(|e| cfg_err(&e))?;
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
            .arg("-c")
            .arg(&conf_path)
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
        let mut child = child;
        // Its log goes with its directory when this fails: the error
        // carries the end of it.
        let tail = |log: &std::path::Path| {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(5)..].join("\n")
        };
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(NatsError::Exited {
                    status: status.to_string(),
                    log: tail(&log),
                });
            }
            if t0.elapsed() > waited {
                return Err(NatsError::NotReady {
                    port,
                    waited,
                    log: tail(&log),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let scheme = if security.tls { "tls" } else { "nats" };
        Ok(EmbeddedNats {
            child,
            url: format!("{scheme}://127.0.0.1:{port}"),
            _dir: dir,
            log,
            ca_file,
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
