//! The example clusters behave like clusters: `scripts/run_cluster.sh`
//! (what `make run-ha` runs: four labelled nodes placing
//! `cluster-config/examples/ha.yaml`) keeps serving when a node dies, restarts it,
//! lets `dynamoctl` find the bus without flags, and stops everything on
//! Ctrl-C (SIGINT to its process group). By default its NATS runs with TLS
//! and a user per role (`dynamoctl nats-auth`); `SECURE=0` runs it plain.

use dynamo_integration::*;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The script as a child in a process group of its own, its output
/// collected line by line.
struct Script {
    child: std::process::Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Script {
    fn start(nats_port: u16, ports: [u16; 2], state_dir: &Path) -> Script {
        Self::start_with(nats_port, ports, state_dir, &[])
    }

    fn start_with(
        nats_port: u16,
        ports: [u16; 2],
        state_dir: &Path,
        env: &[(&str, &str)],
    ) -> Script {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let bin_dir = bin("dynamo-node").parent().unwrap().to_path_buf();
        let mut cmd = Command::new("bash");
        cmd.arg(root.join("scripts/run_cluster.sh"))
            .args(["ha", &format!("{} {}", ports[0], ports[1]), "3"])
            .env("BIN", &bin_dir)
            .env("NATS_PORT", nats_port.to_string())
            .env("DYNAMO_STATE_DIR", state_dir)
            .env_remove("DYNAMO_NATS_URL")
            .envs(env.iter().copied())
            .current_dir(&root)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        // As from a terminal: a shell started in the background (CI runs
        // `make test` so) ignores SIGINT, and bash cannot trap a signal
        // ignored on entry.
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                libc::signal(libc::SIGQUIT, libc::SIG_DFL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("bash runs the script");
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        for out in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(out).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push(l);
                }
            });
        }
        Script { child, lines }
    }

    /// The pids of the processes the script started (its "NAME: pid N" lines).
    fn pids(&self) -> Vec<i32> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| l.split(": pid ").nth(1)?.split(' ').next()?.parse().ok())
            .collect()
    }

    /// Waits (bounded) for the script to exit; its exit code.
    async fn exit_code(&mut self, within: Duration) -> Option<i32> {
        let t0 = Instant::now();
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.code();
            }
            assert!(
                t0.elapsed() < within,
                "the script did not stop:\n{}",
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn output(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// Waits (bounded) until a line contains `what`.
    async fn wait_for(&mut self, what: &str, within: Duration) {
        let t0 = Instant::now();
        while !self.output().contains(what) {
            assert!(
                matches!(self.child.try_wait(), Ok(None)),
                "the script exited:\n{}",
                self.output()
            );
            assert!(
                t0.elapsed() < within,
                "no {what:?} within {within:?}:\n{}",
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        // Whatever happened, nothing is left running.
        let pg = self.child.id() as i32;
        unsafe { libc::kill(-pg, libc::SIGTERM) };
        let t0 = Instant::now();
        while matches!(self.child.try_wait(), Ok(None)) && t0.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(50));
        }
        unsafe { libc::kill(-pg, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

fn prompt(i: usize) -> Vec<u32> {
    (0..40).map(|k| 3000 + (i * 97 + k * 11) as u32).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_ha_survives_a_killed_worker_and_stops_on_ctrl_c() {
    let state = tempfile::tempdir().unwrap();
    let (nats_port, ports) = (free_port(), [free_port(), free_port()]);
    let mut script = Script::start(nats_port, ports, state.path());
    script
        .wait_for("serving on 127.0.0.1", Duration::from_secs(60))
        .await;
    // Secure by default: TLS, and users per role.
    let nats_url = format!("tls://127.0.0.1:{nats_port}");
    let anonymous = async_nats::ConnectOptions::new()
        .add_root_certificates(state.path().join("default.nats-ca.pem"))
        .connect(&nats_url)
        .await;
    assert!(anonymous.is_err(), "a client without a user connected");
    let registrations = || async {
        registrations_via(
            admin_client(&nats_url, "default", state.path()).await,
            "default",
        )
        .await
    };

    // Twelve concurrent greedy streams through the first gateway.
    let streams = Streams::start(ports[0], (0..12).map(prompt).collect(), 200).await;
    // The worker node serving the most of them dies mid-stream (the
    // router's live count says which).
    let (busiest, served) = busiest_worker(&Http::new(ports[0])).await;
    assert!(served > 0);
    let regs = registrations().await;
    let victim = regs
        .iter()
        .find(|r| r.worker_id.to_string() == busiest)
        .map(|r| r.pid)
        .expect("the busiest worker is registered");
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    streams.expect_undisturbed().await;
    // The script saw it and started the node again; the cluster is whole.
    script
        .wait_for(
            &format!("(pid {victim}) exited with status 137"),
            Duration::from_secs(10),
        )
        .await;
    script
        .wait_for(": restarting", Duration::from_secs(10))
        .await;
    let http = Http::new(ports[1]);
    let t0 = Instant::now();
    loop {
        let live = registrations()
            .await
            .into_iter()
            .filter(|r| r.pid != victim)
            .count();
        if live == 3 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the node did not come back:\n{}",
            script.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = http
        .post(
            "/v1/completions",
            &serde_json::json!({"model": MODEL, "prompt": prompt(99), "max_tokens": 4}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.json);

    // `dynamoctl status` finds the bus with no flags.
    let out = Command::new(bin("dynamoctl"))
        .args(["status", "--json"])
        .env("DYNAMO_STATE_DIR", state.path())
        .env_remove("DYNAMO_NATS_URL")
        .output()
        .unwrap();
    assert_success(&out);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["nats_url"], nats_url.as_str(), "{status}");
    let workers = status["workers"].as_array().expect("workers");
    assert_eq!(workers.len(), 3, "{status}");
    assert!(workers.iter().all(|w| w["state"] == "serving"), "{status}");

    // Every actor (gateways, routers, workers, controllers, planners,
    // agents) worked within its role's permissions.
    // (A restarted node appends to its log: one path per node.)
    let logs: std::collections::BTreeSet<String> = script
        .output()
        .lines()
        .filter_map(|l| {
            l.split("(log ")
                .nth(1)?
                .strip_suffix(')')
                .map(str::to_string)
        })
        .collect();
    assert_eq!(logs.len(), 4, "{}", script.output());
    for log in &logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        assert!(!text.contains("Permissions Violation"), "{log}:\n{text}");
    }

    // Ctrl-C: SIGINT to the script's whole process group stops everything.
    unsafe { libc::kill(-(script.child.id() as i32), libc::SIGINT) };
    let t0 = Instant::now();
    let code = loop {
        if let Ok(Some(st)) = script.child.try_wait() {
            break st.code();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "Ctrl-C did not stop the cluster:\n{}",
            script.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(code, Some(0), "{}", script.output());
    assert!(script.output().contains("stopped; logs kept in"));
    for p in [nats_port, ports[0], ports[1]] {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", p)).is_err(),
            "port {p} still served after Ctrl-C"
        );
    }
    assert!(!state.path().join("default.nats-url").exists());
    assert!(!state.path().join("default.nats-ca.pem").exists());
    assert!(!state.path().join("default.nats-creds").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_restart_off_an_exited_node_stays_down_and_two_ctrl_c_stop_everything() {
    let state = tempfile::tempdir().unwrap();
    let (nats_port, ports) = (free_port(), [free_port(), free_port()]);
    // Plain NATS (SECURE=0) keeps working too.
    let mut script = Script::start_with(
        nats_port,
        ports,
        state.path(),
        &[("RESTART", "0"), ("SECURE", "0")],
    );
    script
        .wait_for("serving on 127.0.0.1", Duration::from_secs(60))
        .await;
    let nats_url = format!("nats://127.0.0.1:{nats_port}");
    let pids = script.pids();
    assert_eq!(pids.len(), 4, "NATS is not listed; 4 nodes");
    let victim = registrations_in(&nats_url, "default").await[0].pid;
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    script
        .wait_for(
            &format!("(pid {victim}) exited with status 137"),
            Duration::from_secs(10),
        )
        .await;
    // The others still serve.
    let r = Http::new(ports[0])
        .post(
            "/v1/completions",
            &serde_json::json!({"model": MODEL, "prompt": prompt(7), "max_tokens": 4}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.json);
    // Ctrl-C twice: the second kills what is still draining. The script
    // itself is never signalled by its own stop, and NATS goes too.
    let pg = -(script.child.id() as i32);
    unsafe { libc::kill(pg, libc::SIGINT) };
    let t0 = Instant::now();
    while !script.output().contains("stopping (") && matches!(script.child.try_wait(), Ok(None)) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{}",
            script.output()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    unsafe { libc::kill(pg, libc::SIGINT) };
    let code = script.exit_code(Duration::from_secs(30)).await;
    let out = script.output();
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("stopped; logs kept in"), "{out}");
    assert!(!out.contains(": restarting"), "{out}");
    for p in pids {
        // SAFETY: signal 0 only asks whether the process exists.
        assert!(
            unsafe { libc::kill(p, 0) } != 0,
            "pid {p} left running:\n{out}"
        );
    }
    for p in [nats_port, ports[0], ports[1]] {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", p)).is_err(),
            "port {p} still served:\n{out}"
        );
    }
}
