//! Starting an engine's server process and watching it: placeholders
//! filled with free ports and the model file, its output in our logs, its
//! exit reported to the engine's driver.
//!
//! Invariants: the process leads a process group of its own, and the whole
//! group (the processes an engine like vLLM starts, or a wrapper's child)
//! is killed when its [`Launched`] is dropped (the engine handle, hence the
//! worker, went away) and after the process exits. When the node process
//! dies, the process itself gets `SIGKILL` (`PR_SET_PDEATHSIG`); what it
//! started is then its own to stop. Its last [`TAIL_LINES`] lines of
//! output are kept, so an exit during start-up says why.

use crate::config::{ExternalConfig, Launch};
use std::collections::VecDeque;
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use thiserror::Error;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinSet;

/// Lines of the engine's output kept for error messages.
pub const TAIL_LINES: usize = 20;
/// Longest line logged (longer ones are cut).
const MAX_LOG_LINE: usize = 4096;

#[derive(Debug, Error)]
pub enum LaunchError {
    #[error("no free port: {0}")]
    Port(std::io::Error),
    #[error("cannot start {program:?}: {cause}")]
    Spawn {
        program: String,
        cause: std::io::Error,
    },
    #[error("`{{model_path}}` is used but the worker has no model file")]
    NoModelPath,
}

/// A free TCP port on the loopback interface (the OS's pick, released for
/// the engine to bind).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The values placeholders stand for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fill {
    pub port: Option<u16>,
    pub kv_port: Option<u16>,
    pub replay_port: Option<u16>,
    pub model_path: Option<String>,
}

impl Fill {
    /// Picks ports for the placeholders `cfg` uses.
    pub fn for_config(
        cfg: &ExternalConfig,
        model_path: Option<&Path>,
    ) -> Result<Fill, LaunchError> {
        let mut all: Vec<&str> = vec![cfg.url.as_str()];
        if let Some(l) = &cfg.launch {
            all.extend(l.command.iter().map(String::as_str));
        }
        if let Some(k) = &cfg.kv_events {
            all.push(&k.endpoint);
            all.extend(k.replay_endpoint.as_deref());
        }
        let uses = |p: &str| all.iter().any(|s| s.contains(p));
        let port = |used: bool| -> Result<Option<u16>, LaunchError> {
            used.then(free_port).transpose().map_err(LaunchError::Port)
        };
        let model_path = if uses("{model_path}") {
            Some(
                model_path
                    .ok_or(LaunchError::NoModelPath)?
                    .to_string_lossy()
                    .into_owned(),
            )
        } else {
            None
        };
        Ok(Fill {
            port: port(uses("{port}"))?,
            kv_port: port(uses("{kv_port}"))?,
            replay_port: port(uses("{replay_port}"))?,
            model_path,
        })
    }

    pub fn apply(&self, s: &str) -> String {
        let mut s = s.to_string();
        for (k, v) in [
            ("{port}", self.port.map(|p| p.to_string())),
            ("{kv_port}", self.kv_port.map(|p| p.to_string())),
            ("{replay_port}", self.replay_port.map(|p| p.to_string())),
            ("{model_path}", self.model_path.clone()),
        ] {
            if let Some(v) = v {
                s = s.replace(k, &v);
            }
        }
        s
    }
}

/// The last lines an engine printed.
#[derive(Clone, Debug, Default)]
pub struct Tail(Arc<Mutex<VecDeque<String>>>);

impl Tail {
    fn push(&self, line: String) {
        if let Ok(mut t) = self.0.lock() {
            if t.len() == TAIL_LINES {
                t.pop_front();
            }
            t.push_back(line);
        }
    }

    pub fn lines(&self) -> Vec<String> {
        self.0
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// A running engine process.
pub struct Launched {
    pub child: Child,
    pub tail: Tail,
    /// Its process group (its own pid).
    pgid: Option<i32>,
}

impl Launched {
    /// Waits for the process to exit, then kills what is left of its group.
    pub async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        let st = self.child.wait().await;
        self.kill_group();
        st
    }

    fn kill_group(&mut self) {
        if let Some(g) = self.pgid.take() {
            // SAFETY: signals a process group we created; ESRCH (gone) is fine.
            unsafe { libc::killpg(g, libc::SIGKILL) };
        }
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        self.kill_group();
    }
}

async fn pump(
    r: impl AsyncRead + Unpin + Send + 'static,
    worker: String,
    stream: &'static str,
    tail: Tail,
) {
    let mut lines = BufReader::new(r).lines();
    while let Ok(Some(mut line)) = lines.next_line().await {
        if line.len() > MAX_LOG_LINE {
            let mut cut = MAX_LOG_LINE;
            while !line.is_char_boundary(cut) {
                cut -= 1;
            }
            line.truncate(cut);
        }
        tracing::info!(target: "engine", worker = %worker, stream, "{line}");
        tail.push(line);
    }
}

/// Starts the process; its output is logged by tasks put in `tasks`.
pub fn launch(
    l: &Launch,
    fill: &Fill,
    worker: &str,
    tasks: &mut JoinSet<()>,
) -> Result<Launched, LaunchError> {
    let args: Vec<String> = l.command.iter().map(|a| fill.apply(a)).collect();
    let mut cmd = Command::new(&args[0]);
    cmd.args(&args[1..])
        .envs(&l.env)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .process_group(0);
    #[cfg(target_os = "linux")]
    // SAFETY: prctl is async-signal-safe and touches only the child's own
    // state, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
        program: args[0].clone(),
        cause: source,
    })?;
    tracing::info!(worker, pid = child.id(), command = ?args, "engine process started");
    let tail = Tail::default();
    if let Some(o) = child.stdout.take() {
        tasks.spawn(pump(o, worker.to_string(), "stdout", tail.clone()));
    }
    if let Some(e) = child.stderr.take() {
        tasks.spawn(pump(e, worker.to_string(), "stderr", tail.clone()));
    }
    let pgid = child.id().map(|p| p as i32);
    Ok(Launched { child, tail, pgid })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{RawExternal, RawLaunch};

    #[test]
    fn placeholders_get_distinct_free_ports() {
        let cfg = RawExternal {
            api: Some("llamacpp".into()),
            launch: Some(RawLaunch {
                command: vec![
                    "srv".into(),
                    "--port={port}".into(),
                    "-m".into(),
                    "{model_path}".into(),
                ],
                ..Default::default()
            }),
            ..Default::default()
        }
        .validate()
        .unwrap();
        let f = Fill::for_config(&cfg, Some(Path::new("/m.gguf"))).unwrap();
        let p = f.port.unwrap();
        assert_eq!(f.apply(&cfg.url), format!("http://127.0.0.1:{p}"));
        assert_eq!(f.apply("--port={port}"), format!("--port={p}"));
        assert_eq!(f.apply("{model_path}"), "/m.gguf");
        assert_eq!(f.kv_port, None);
        assert!(matches!(
            Fill::for_config(&cfg, None),
            Err(LaunchError::NoModelPath)
        ));
    }

    #[tokio::test]
    async fn output_is_kept_and_exit_seen() {
        let l = Launch {
            command: vec![
                "sh".into(),
                "-c".into(),
                "echo one; echo two >&2; exit 3".into(),
            ],
            env: Default::default(),
        };
        let mut tasks = JoinSet::new();
        let mut p = launch(&l, &Fill::default(), "w", &mut tasks).unwrap();
        let st = p.wait().await.unwrap();
        assert_eq!(st.code(), Some(3));
        while tasks.join_next().await.is_some() {}
        let mut lines = p.tail.lines();
        lines.sort();
        assert_eq!(lines, ["one", "two"]);
        // Dropped, the whole group goes: a grandchild included.
        let l = Launch {
            command: vec!["sh".into(), "-c".into(), "sleep 30 & echo $!; wait".into()],
            env: Default::default(),
        };
        let p = launch(&l, &Fill::default(), "w", &mut tasks).unwrap();
        let t0 = std::time::Instant::now();
        let grandchild: i32 = loop {
            if let Some(pid) = p.tail.lines().first().and_then(|l| l.trim().parse().ok()) {
                break pid;
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(5),
                "no pid printed"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        };
        drop(p);
        let gone = |pid: i32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map_or(true, |s| s.contains(") Z "))
        };
        while !gone(grandchild) {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(5),
                "the grandchild survived"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let bad = Launch {
            command: vec!["/nonexistent/engine".into()],
            env: Default::default(),
        };
        assert!(matches!(
            launch(&bad, &Fill::default(), "w", &mut tasks),
            Err(LaunchError::Spawn { .. })
        ));
    }
}
